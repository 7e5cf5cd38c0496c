"""The engine: `step()` is schedule -> execute -> update, the one generation path of afd.

Serving runs it on a thread of its own (`start`): requests come in through a thread-safe inbox and
each step's deltas go out through the request's `on_output` callback. With nothing to run, that
thread sends the FFN nodes an idle step (they pace themselves by the busy attention nodes and need to
hear from every peer) and backs off while the whole cluster is idle: to IDLE_BACKOFF_MAX where other attention
nodes' steps wait for this one's, to ALONE_BACKOFF_MAX where none does. A data-plane failure pauses the
requests while the plane re-forms (`membership`), or, with no membership or nobody back in time,
fails every request with an error and marks the engine dead, which /health reports. Offline generation
(afd.engine.offline) calls `step()` itself until its requests are done.

A step: the scheduler's plan (afd.engine.messages.StepPlan) -> the runner's output (logits, hidden
states) -> the sampler's tokens -> the scheduler's update (cached tokens, KV of rejected drafts) -> the
output processor (stops, text, deltas; afd.engine.output_processor), whose counts the metrics take.
With speculative decoding (`speculative_tokens` N > 0, afd.engine.speculative) a step verifies each
request's drafts and may emit up to N + 1 tokens for it; then the MTP module drafts the next ones from
the runner's hidden states.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

from afd.backend.base import bind_device
from afd.dataplane.transport import PeerError
from afd.engine.membership import PlaneMembership
from afd.engine.messages import AbortRequest, AddRequest, RunnerOutput, StepPlan, StepStats
from afd.engine.output_processor import Counts, OutputProcessor
from afd.engine.request import Request
from afd.engine.runner import ModelRunner
from afd.engine.sampling import Sampler, sample_step
from afd.engine.scheduler import Scheduler
from afd.engine.speculative import Speculator
from afd.engine.tokenizer import Tokenizer
from afd.observability.attention_metrics import AttentionMetrics

log = logging.getLogger("afd.engine")
IDLE_BACKOFF_MAX = 0.05
"""Seconds at most between idle steps where other attention nodes share the FFN nodes: a request that arrives
at one of them waits this long at most for this node's next header before its first FFN step."""
ALONE_BACKOFF_MAX = 0.25
"""The same where this is the only attention node: its idle steps only tell the FFN nodes it lives (they wait
for a header comm_timeout at most) and a request wakes the engine at once, so a longer backoff delays nothing;
an idle 1A1F cluster then takes under 3 % of a core instead of 5 % (measured on a 2-core Xeon, 2026-12-07)."""


class EngineDead(RuntimeError):
    """The engine stopped (a peer died or it was shut down); no request can run."""


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        tokenizer: Tokenizer | None,
        eos_ids: tuple[int, ...],
        max_model_len: int,
        metrics: AttentionMetrics | None = None,
        speculative_tokens: int = 0,
        idle_backoff_max: float = IDLE_BACKOFF_MAX,
    ):
        """speculative_tokens: MTP drafts per step (0: off; the runner then needs the MTP module).
        idle_backoff_max: IDLE_BACKOFF_MAX, or ALONE_BACKOFF_MAX for the only attention node."""
        self.runner, self.scheduler, self.tokenizer = runner, scheduler, tokenizer
        self.eos_ids, self.max_model_len, self.metrics = eos_ids, max_model_len, metrics
        self.idle_backoff_max = idle_backoff_max
        self.sampler = Sampler(eos_ids)
        self.processor = OutputProcessor(scheduler, self.sampler, tokenizer, eos_ids, max_model_len)
        self.spec = Speculator(runner, scheduler, speculative_tokens) if speculative_tokens else None
        if self.spec is not None and metrics is not None:
            metrics.watch_spec_decode(self.spec.stats)
        self._inbox: queue.SimpleQueue[AddRequest | AbortRequest] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.dead: str | None = None
        self.paused: str | None = None
        """Why the engine is waiting for the data plane to re-form (requests wait, /health is 503)."""
        self.paused_peer: int | None = None
        """The data-plane rank whose failure paused it, where the failure names one."""
        self.membership: PlaneMembership | None = None
        """Serving sets it (afd.node.runtime); offline generation runs without."""
        self.on_pause: Callable[[], None] | None = None
        """Called from the engine's thread each time `paused` is set or cleared: the serving node's heartbeat
        then carries it at once, so that afd status agrees with /health."""
        self.on_dead: Callable[[str], None] | None = None
        """Called once, from the engine's thread, when it stops for good (`dead`): the serving node exits then."""
        self._thread = threading.Thread(target=self._loop, name="afd-engine", daemon=True)
        self._preemptions_seen = 0
        self._prefix_seen = (0, 0)

    # ---- called from other threads ----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def add_request(self, req: Request) -> None:
        if self.dead:
            raise EngineDead(self.dead)
        self._inbox.put(AddRequest(req))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(AbortRequest(request_id))
        self._wake.set()

    def num_unfinished(self) -> int:
        return len(self.processor.requests) + self._inbox.qsize()

    def has_unfinished(self) -> bool:
        return bool(self.processor.requests) or not self._inbox.empty()

    def stop(self, timeout: float = 10.0) -> None:
        """Leaves the data plane after the current step."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    # ---- the engine thread ------------------------------------------------------------------------

    def step(self) -> StepStats | None:
        """schedule -> execute -> update; None when nothing could be scheduled."""
        self._drain_inbox()
        plan = self.scheduler.schedule()
        if not plan:
            return None
        out, stats = self._execute(plan)
        now = time.monotonic()
        sampled = sample_step(self.sampler, plan, out.logits)
        for k, e in sampled.errors.items():  # that request alone fails
            self.processor.fail(plan.seqs[k].request, e)
        self.runner.exchange().check()  # after the host read: an aborted transfer's tokens are never emitted
        self.runner.tp.check()  # and an aborted TP collective's
        self.scheduler.update(plan, sampled.tokens)
        counts = self.processor.process(plan, sampled, out.logits, now)
        self._count(counts)
        self._refresh_gauges()
        stats = dataclasses.replace(stats, generated=counts.tokens)
        if self.spec is None:
            return stats
        t0 = time.perf_counter()
        self.spec.propose(plan, sampled.tokens, out.hidden, self.max_model_len)
        return dataclasses.replace(stats, draft_seconds=time.perf_counter() - t0)

    def _loop(self) -> None:
        backoff = 0.0
        try:
            bind_device(self.runner.device)  # the current device is per thread; this one issues the device work
            while not self._stop.is_set():
                failed, peer = None, None
                self._adopt()
                try:
                    if self.step() is not None:
                        backoff = 0.0
                        continue
                    else:
                        busy = self.runner.idle()
                except PeerError as e:
                    if not self._can_rejoin():
                        raise
                    failed, peer = str(e), e.peer  # leave the except block first: its traceback pins the old group
                if failed is not None:
                    self._rejoin(failed, peer)
                    continue
                backoff = 0.0 if busy else min(self.idle_backoff_max, max(0.001, 2 * backoff))
                if not busy and self._wake.wait(backoff):
                    self._wake.clear()
            self.runner.leave()  # the FFN nodes stop once every attention node has left
        except PeerError as e:
            self._die(str(e))
        except Exception as e:  # a bug must not leave requests hanging
            log.exception("engine failed")
            self._die(f"engine failed: {e}")

    def _adopt(self) -> None:
        """Between steps: FFN nodes that are back take their share (PlaneMembership.adopt)."""
        if self.membership is not None and self.membership.adopt is not None:
            moe = self.membership.adopt()
            if moe is not None:
                self.runner.moe = moe

    def _can_rejoin(self) -> bool:
        return self.membership is not None and self.membership.rejoin is not None

    def _rejoin(self, e: str, peer: int | None) -> None:
        """A peer failed mid-step: form this node's pairs again (waiting for a dead FFN node's
        replacement), then run the step again. Nothing is lost: the step's sampling never ran, and its KV
        writes land in the same slots when it reruns."""
        self.paused, self.paused_peer = e, peer
        log.warning("requests paused: %s", e)
        self._paused_changed()
        self.runner.moe = None  # drop the exchange over the failed pairs before they are torn down
        rejoin = None if self.membership is None else self.membership.rejoin
        try:
            if rejoin is None:
                raise RuntimeError("no membership to rejoin through")
            self.runner.moe = rejoin(e)
        except Exception as err:  # ControlError: nobody came back in time
            raise PeerError(f"{e}; {err}") from None
        self.paused, self.paused_peer = None, None
        self._paused_changed()
        log.info("data plane re-formed; %d request(s) resume", len(self.processor.requests))

    def _paused_changed(self) -> None:
        if self.on_pause is not None:
            self.on_pause()

    def _die(self, reason: str) -> None:
        self.dead = reason
        log.error("engine stopped: %s", reason)
        self.runner.moe = None
        if self.membership is not None:
            self.membership.release()
        if self.on_dead is not None:
            self.on_dead(reason)
        while True:  # fail whatever still arrives: a request may slip into the inbox as `dead` is set
            self._drain_inbox()
            for req in list(self.processor.requests.values()):
                self.processor.abort(req, error=reason)
            self._refresh_gauges()
            if self._stop.wait(0.05):
                return

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, AddRequest):
                if self.dead:  # _die fails it with the reason
                    self.processor.requests[msg.request.request_id] = msg.request
                elif self.processor.add(msg.request):
                    self.scheduler.add(msg.request)
            elif msg.request_id in self.processor.requests:
                self._count(self.processor.abort(self.processor.requests[msg.request_id]))
                self._refresh_gauges()

    def _execute(self, plan: StepPlan) -> tuple[RunnerOutput, StepStats]:
        now = time.monotonic()
        for s in plan:
            req = s.request
            if req.first_scheduled is None:
                req.first_scheduled = now
                if self.metrics:
                    self.metrics.queue.observe(now - req.arrival)
        decoding = [bool(s.request.output_ids) and s.request.num_tokens - s.start == 1 for s in plan]
        t0 = time.perf_counter()
        out = self.runner.execute(plan.step_seqs())
        ex = out.exchange
        phase = "decode" if all(decoding) else "prefill" if not any(decoding) else "mixed"
        stats = StepStats(plan.num_tokens, time.perf_counter() - t0, ex.ffn_wait, ex.to_ffn, phase)
        if self.metrics:
            m = self.metrics
            m.step(stats.phase).observe(stats.seconds)
            m.ffn_wait.observe(stats.ffn_wait)
            m.a2f_bytes.inc(stats.a2f_bytes)
            for direction, n in ex.bytes().items():
                if n:  # a colocated step exchanges nothing: no series
                    m.exchange_bytes(direction).inc(n)
            m.zero_expert_tokens.inc(ex.zero_slots)
            m.micro_batches.set(out.micro_batches)
        return out, stats

    def _count(self, c: Counts) -> None:
        m = self.metrics
        if m is None:
            return
        m.generation_tokens.inc(c.tokens)
        m.prompt_tokens.inc(c.prompt_tokens)
        for seconds in c.first_token_seconds:
            m.ttft.observe(seconds)
        for seconds in c.inter_token_seconds:
            m.itl.observe(seconds)
        for f in c.finished:
            m.success(f.reason).inc()
            m.e2e.observe(f.seconds)

    def _refresh_gauges(self) -> None:
        if self.metrics:
            s = self.scheduler
            self.metrics.running.set(len(s.running))
            self.metrics.waiting.set(len(s.waiting))
            self.metrics.kv_usage.set(s.kv.usage())
            self.metrics.engine_dead.set(self.dead is not None)
            self.metrics.preemptions.inc(s.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = s.num_preemptions
            if s.prefix is not None:
                queries, hits = self._prefix_seen
                self.metrics.prefix_cache_queries.inc(s.prefix.queries - queries)
                self.metrics.prefix_cache_hits.inc(s.prefix.hits - hits)
                self._prefix_seen = (s.prefix.queries, s.prefix.hits)
