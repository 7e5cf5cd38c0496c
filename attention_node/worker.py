"""The attention node's offline mode: jobs of prompts, one after another, then leave.

It comes up like any node of a cluster YAML (control plane, ranks, data plane) and, instead of serving
HTTP, runs each job on an engine of its own (afd.engine.offline: its KV cache sized for the job) over
the same data plane and control plane, which stay up between jobs. Jobs come from a mailbox
(afd.cluster.jobs): `afd generate --attention-nodes A --ffn-nodes F`, `afd.LLM(..., attention_nodes=A)`
and `afd bench-step` hand them over through afd.cluster.local.

Between jobs rank 0 sends the FFN nodes idle steps, as the serving engine does: they wait for a header
from every attention peer each step, and pace their idle peers by the busy ones' steps. A node's TP ranks
> 0 get each job (its prompts and limits, to size their KV caches alike) from rank 0 over the TP group,
and run its steps, idle steps and the final leave as rank 0 sends them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter

import torch

from afd.backend import host_syncs
from afd.cluster.jobs import STOP, jobs_of
from afd.control.client import ControlError
from afd.dataplane.transport import PeerError
from afd.engine import offline
from afd.engine.engine import Engine
from afd.engine.factory import Job, build_engine
from afd.engine.graph import graph_report
from afd.engine.messages import IdleStep, LeaveStep, RunJob, RunStep
from afd.engine.sampling import SamplingParams
from afd.observability.timing import LayerTimes
from attention_node.node import AttentionNode

JOB_WAIT_BACKOFF_MAX = 0.25
"""Seconds at most between idle steps while no job is queued: a kept cluster (afd.LLM between generate()
calls, a test's shared cluster) then costs little CPU on the cores the running work needs, for at most
this much delay before the next job starts. (While a job runs, other nodes' steps pace this one.)"""

log = logging.getLogger("afd.attention")


class OfflineNode(AttentionNode):
    """An offline attention rank (`afd-attention generate`, `--tp-rank R` for rank R > 0)."""

    def __init__(self, cfg, args, tp_rank: int = 0):
        super().__init__(cfg, args, tp_rank)
        self.jobs = jobs_of(args.prompts_file, getattr(args, "output_file", None)) if tp_rank == 0 else None
        self.stopping = threading.Event()
        """SIGTERM: leave at the next step between jobs."""
        self.done = threading.Event()
        """Set once the node has left the data plane (or failed)."""
        self.serving = False
        self._launcher = os.getppid()

    def serve(self) -> int:
        self.serving = True
        if self.cfg.engine.sampling_seed is not None:  # once, as vLLM seeds its engine (and afd serve --seed)
            torch.manual_seed(self.cfg.engine.sampling_seed)
        try:
            if self.tp_rank > 0:
                self._follow()
                log.info("TP rank %d done", self.tp_rank)
            else:
                self._run_jobs()
            return 0
        except PeerError as e:  # TPError is one
            log.error("stopping: %s", e)
            return 1
        except (ControlError, OSError, ValueError) as e:  # a job the node cannot run
            log.error("stopping: %s: %s", type(e).__name__, e)
            return 1
        finally:
            self.done.set()
            self.close()

    def stop(self) -> None:
        self.stopping.set()
        if self.serving and not self.done.wait(10.0):
            log.warning("no step between jobs within 10s of the signal; exiting")
        super().stop()

    # ---- rank 0 ----------------------------------------------------------------------------------

    def _run_jobs(self) -> None:
        jobs = self.jobs
        assert jobs is not None  # rank 0's (tp_rank 0)
        n, backoff = jobs.first_open(), 0.0  # a restarted node: the job it died in, again
        while not self.stopping.is_set():
            job = jobs.take(n)
            if job == STOP:
                break
            if job is None and os.getppid() != self._launcher:  # it died without stopping us
                log.warning("the process that started this node is gone; leaving")
                break
            if job is None:  # between jobs: the FFN nodes still hear from this node every step
                busy = self._idle()
                backoff = 0.0 if busy else min(JOB_WAIT_BACKOFF_MAX, max(0.001, 2 * backoff))
                time.sleep(backoff)
                continue
            assert isinstance(job, dict)  # take() gives a job, STOP or None
            jobs.put_result(n, self._run(job))
            n, backoff = n + 1, 0.0
        if self.tp.size > 1:
            self.tp.send_step(LeaveStep())
        self.live_moe.leave()

    def _idle(self) -> int:
        """An idle step (afd.engine.runner.ModelRunner.idle, without a job's runner)."""
        if self.tp.size > 1:
            self.tp.send_step(IdleStep())
        return self.live_moe.idle()

    def _run(self, job: dict) -> dict:
        """One job's result. A job may ask for `logits` and for `layer_times` (the runner's per-piece times of
        each layer and a mark per step, for `afd profile` to time the attention side where it runs); neither
        costs anything unless asked."""
        prompts = job["prompts"]
        per = offline.validate_prompts(self.rt.model_cfg, prompts, job["max_tokens"]) if prompts else []
        if self.tp.size > 1:
            self.tp.send_step(RunJob(prompts, per))
        engine = self._engine(prompts, per)
        before = _tp_counters(self.tp)
        steps: list[dict] = []
        logits: list | None = [] if job.get("logits") else None
        times = LayerTimes() if job.get("layer_times") else None
        engine.runner.layer_times = times  # None, the default: the runner times nothing
        marks: list[tuple[float, int]] = []

        a2f = 0

        def on_step(s) -> None:
            nonlocal a2f
            a2f += s.a2f_bytes
            steps.append(s.report())
            if times is not None:  # the step's end and the samples by then: afd.plan.profile_measure.split_steps
                marks.append((time.perf_counter(), len(times.samples)))

        out = offline.generate(
            engine,
            prompts,
            per,
            SamplingParams(**job.get("sampling", {})),
            job.get("ignore_eos", False),
            logits,
            on_step=on_step,
            progress=True,
        )
        tp_bytes, tp_fallbacks = _since(before, _tp_counters(self.tp))
        log.info("generated %d sequences in %d steps", len(out), len(steps))
        return {
            "outputs": out,
            "steps": steps,
            "a2f_bytes": a2f,
            "micro_batches": engine.runner.micro_batches,
            "limits": {
                "max_num_seqs": engine.scheduler.max_num_seqs,
                "prefix_caching": engine.scheduler.prefix is not None,
            },
            "tp_bytes": tp_bytes,
            "tp_fallbacks": tp_fallbacks,
            "spec_decode": engine.spec.stats.report() if engine.spec else None,
            "graph": graph_report(engine.runner.attn),
            "logits": [[host_syncs.to_list(t) for t in p] for p in logits] if logits is not None else None,
            "layer_times": {"samples": times.samples, "marks": marks} if times is not None else None,
        }

    def _engine(self, prompts: list[list[int]], per: list[int]) -> Engine:
        """A job's engine over this node's half and exchange: every rank sizes its KV cache alike."""
        return build_engine(
            self.cfg,
            self.half,
            self.live_moe,
            self.rt.backend.device,
            tp=self.tp,
            mtp=self.loaded.mtp,
            backend=self.rt.backend,
            job=Job(prompts, per),
        )

    # ---- TP ranks > 0 ----------------------------------------------------------------------------

    def _follow(self) -> None:
        """afd.engine.runner.follow, with jobs in between: each job brings its own runner."""
        self.rt.backend.bind_thread()
        runner = None
        while True:
            msg = self.tp.recv_step()
            if isinstance(msg, RunJob):
                runner = self._engine(msg.prompts, msg.max_tokens).runner
            elif isinstance(msg, RunStep) and runner is not None:
                runner.execute(msg.seqs, micro_batches=msg.micro_batches)
            elif isinstance(msg, IdleStep):
                self.live_moe.idle()
            elif isinstance(msg, LeaveStep):
                self.live_moe.leave(shutdown=msg.shutdown)
                return
            else:
                raise TypeError(f"TP rank {self.tp.rank}: unexpected message from the leader: {msg!r}")


def _tp_counters(tp) -> tuple[Counter, Counter]:
    return Counter(tp.bytes), Counter(tp.fallbacks)


def _since(before: tuple, after: tuple) -> tuple[dict, dict]:
    """A job's own TP bytes and fallbacks: the TP group counts them for the node's life."""
    return dict(after[0] - before[0]), dict(after[1] - before[1])
