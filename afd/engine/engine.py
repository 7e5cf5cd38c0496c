"""The engine: `step()` is schedule -> execute -> update, the one generation path of afd.

Serving runs it on a thread of its own (`start`): requests come in through a thread-safe inbox and
each step's deltas go out through the request's `on_output` callback. With nothing to run, that
thread sends the FFN nodes an idle step (they pace themselves by the busy attention nodes and need to
hear from every peer) and backs off while the whole cluster is idle. A data-plane failure pauses the
requests while the plane re-forms (`membership`), or, with no membership or nobody back in time,
fails every request with an error and marks the engine dead, which /health reports. Offline generation
(afd.engine.offline) calls `step()` itself until its requests are done.

With speculative decoding (`speculative_tokens` N > 0, afd.engine.speculative) a step verifies each
request's drafts and may emit up to N + 1 tokens for it; after the update the MTP module drafts the next
ones.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from afd.backend.base import bind_device
from afd.dataplane.transport import PeerError
from afd.engine.membership import PlaneMembership
from afd.engine.request import Request, RequestOutput, Status
from afd.engine.runner import ModelRunner
from afd.engine.sampling import Sampler, sample_step, top_logprobs
from afd.engine.scheduler import Scheduler
from afd.engine.speculative import Speculator, step_seq
from afd.engine.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop
from afd.observability.metrics import AttentionMetrics

log = logging.getLogger("afd.engine")
IDLE_BACKOFF_MAX = 0.05


class EngineDead(RuntimeError):
    """The engine stopped (a peer died or it was shut down); no request can run."""


@dataclass(frozen=True)
class StepStats:
    """What one forward step did (metrics and benchmarks read it)."""

    num_tokens: int
    seconds: float
    ffn_wait: float
    """Seconds the step was blocked waiting for MoE outputs: the exchange that was not hidden."""
    a2f_bytes: int
    phase: str
    """prefill, decode or mixed."""
    generated: int = 0
    """Tokens the step emitted (up to N + 1 per decoding request with N speculative tokens)."""
    draft_seconds: float = 0.0
    """Seconds the MTP module took to draft the next step's tokens (speculative decoding)."""

    def report(self) -> dict:
        """The per-step record offline jobs write (afd.bench reads it)."""
        return {
            "tokens": self.num_tokens,
            "seconds": self.seconds,
            "ffn_wait": self.ffn_wait,
            "generated": self.generated,
            "draft_seconds": self.draft_seconds,
        }


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
    ):
        """speculative_tokens: MTP drafts per step (0: off; the runner then needs the MTP module)."""
        self.runner, self.scheduler, self.tokenizer = runner, scheduler, tokenizer
        self.eos_ids, self.max_model_len, self.metrics = eos_ids, max_model_len, metrics
        self.sampler = Sampler(eos_ids)
        self.spec = Speculator(runner, speculative_tokens) if speculative_tokens else None
        if self.spec is not None and metrics is not None:
            metrics.watch_spec_decode(self.spec.stats)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.dead: str | None = None
        self.paused: str | None = None
        """Why the engine is waiting for the data plane to re-form (requests wait, /health is 503)."""
        self.membership: PlaneMembership | None = None
        """Serving sets it (afd.node.runtime); offline generation runs without."""
        self._thread = threading.Thread(target=self._loop, name="afd-engine", daemon=True)
        self._requests: dict[str, Request] = {}
        self._preemptions_seen = 0

    # ---- called from other threads ----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def add_request(self, req: Request) -> None:
        if self.dead:
            raise EngineDead(self.dead)
        self._inbox.put(("add", req))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def num_unfinished(self) -> int:
        return len(self._requests) + self._inbox.qsize()

    def has_unfinished(self) -> bool:
        return bool(self._requests) or not self._inbox.empty()

    def stop(self, timeout: float = 10.0) -> None:
        """Leaves the data plane after the current step."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    # ---- the engine thread ------------------------------------------------------------------------

    def step(self) -> StepStats | None:
        """schedule -> execute -> update; None when nothing could be scheduled."""
        self._drain_inbox()
        batch = self.scheduler.schedule()
        if not batch:
            return None
        logits, stats = self._execute(batch)
        generated = sum(len(r.output_ids) for r, _ in batch)
        advanced = self._update(batch, logits)
        generated = sum(len(r.output_ids) for r, _ in batch) - generated
        if self.spec is None:
            return dataclasses.replace(stats, generated=generated)
        t0 = time.perf_counter()
        self.spec.propose(advanced, self.max_model_len)
        return dataclasses.replace(stats, generated=generated, draft_seconds=time.perf_counter() - t0)

    def _loop(self) -> None:
        backoff = 0.0
        try:
            bind_device(self.runner.device)  # the current device is per thread; this one issues the device work
            while not self._stop.is_set():
                failed = None
                try:
                    if self._can_rejoin() and self.membership.superseded():
                        self.runner.leave(reform=True)
                        failed = "a node was replaced: moving to the next data-plane generation"
                    elif self.step() is not None:
                        backoff = 0.0
                        continue
                    else:
                        busy = self.runner.idle()
                except PeerError as e:
                    if not self._can_rejoin():
                        raise
                    failed = str(e)  # leave the except block first: its traceback pins the old process group
                if failed is not None:
                    self._rejoin(failed)
                    continue
                backoff = 0.0 if busy else min(IDLE_BACKOFF_MAX, max(0.001, 2 * backoff))
                if not busy and self._wake.wait(backoff):
                    self._wake.clear()
            self.runner.leave()  # the FFN nodes stop once every attention node has left
        except PeerError as e:
            self._die(str(e))
        except Exception as e:  # a bug must not leave requests hanging
            log.exception("engine failed")
            self._die(f"engine failed: {e}")

    def _can_rejoin(self) -> bool:
        return self.membership is not None and self.membership.rejoin is not None

    def _rejoin(self, e: str) -> None:
        """A peer failed mid-step (or the plane is being re-formed): wait for the next generation, then
        run the step again. Nothing is lost: the step's sampling never ran, and its KV writes land in the
        same slots when it reruns."""
        self.paused = e
        log.warning("requests paused: %s", e)
        self.runner.moe = None  # drop the exchange over the failed generation before it is torn down
        try:
            self.runner.moe = self.membership.rejoin(e)
        except Exception as err:  # ControlError: nobody came back in time
            raise PeerError(f"{e}; {err}") from None
        self.paused = None
        log.info("data plane re-formed; %d request(s) resume", len(self._requests))

    def _die(self, reason: str) -> None:
        self.dead = reason
        log.error("engine stopped: %s", reason)
        self.runner.moe = None
        if self.membership is not None:
            self.membership.release()
        while True:  # fail whatever still arrives: a request may slip into the inbox as `dead` is set
            self._drain_inbox()
            for req in list(self._requests.values()):
                self._emit(req, [], "", finish_reason="abort", error=reason)
            self._refresh_gauges()
            if self._stop.wait(0.05):
                return

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._requests[item.request_id] = item
                if self.dead:
                    continue
                try:
                    if self.tokenizer is not None:
                        item.detok = IncrementalDetokenizer(self.tokenizer, item.prompt_ids)
                except Exception as e:
                    self._fail(item, e)
                    continue
                self.scheduler.add(item)
            elif item in self._requests:
                self._emit(self._requests[item], [], "", finish_reason="abort")
                self._refresh_gauges()

    def _execute(self, batch: list[tuple[Request, int]]) -> tuple[torch.Tensor, StepStats]:
        now = time.monotonic()
        for req, _ in batch:
            if req.first_scheduled is None:
                req.first_scheduled = now
                if self.metrics:
                    self.metrics.queue.observe(now - req.arrival)
        seqs = [step_seq(req, n) for req, n in batch]
        moe = self.runner.moe
        wait0, sent0 = moe.timers.total("ffn_wait"), getattr(moe, "bytes_sent", 0)
        t0 = time.perf_counter()
        logits = self.runner.execute(seqs)
        decoding = [bool(req.output_ids) and req.num_tokens - req.num_computed == 1 for req, _ in batch]
        stats = StepStats(
            sum(n for _, n in batch),
            time.perf_counter() - t0,
            moe.timers.total("ffn_wait") - wait0,
            getattr(moe, "bytes_sent", 0) - sent0,
            "decode" if all(decoding) else "prefill" if not any(decoding) else "mixed",
        )
        if self.metrics:
            m = self.metrics
            m.step(stats.phase).observe(stats.seconds)
            m.ffn_wait.observe(stats.ffn_wait)
            m.a2f_bytes.inc(stats.a2f_bytes)
            m.micro_batches.set(self.runner.last_micro_batches)
        return logits, stats

    def _update(self, batch: list[tuple[Request, int]], logits: torch.Tensor) -> list[tuple[Request, int, int]]:
        """Appends the step's tokens. Returns (request, tokens cached before the step, its first row in the
        step) per request: where the MTP module drafts from."""
        rows, reqs, drafts, advanced = [], [], [], []
        row = q = 0
        for req, n in batch:
            d = max(0, req.num_computed + n - req.num_tokens)  # drafts the step verifies
            advanced.append((req, req.num_computed, q))
            req.num_computed += n - d  # a draft's KV counts once it is accepted
            if req.num_computed == req.num_tokens:  # the chunk reached the end: a token is due
                rows.append(row)
                reqs.append(req)
                drafts.append(req.draft[:d])
            req.draft = []
            row, q = row + d + 1, q + n
        now = time.monotonic()
        for row, req, d, toks in zip(
            rows, reqs, drafts, sample_step(self.sampler, logits, rows, reqs, drafts, self._fail)
        ):
            if toks is None:
                continue
            req.num_computed += len(toks) - 1  # the accepted drafts
            if d:
                self.spec.stats.observe(len(d), len(toks) - 1)
            try:
                for j, tok in enumerate(toks):
                    if req.status is Status.FINISHED:  # EOS, a stop or the length limit came first
                        break
                    if req.logits is not None:
                        req.logits.append(logits[row + j].clone())
                    k = req.params.logprobs
                    self._append(req, tok, now, None if k is None else top_logprobs(logits[row + j], tok, k))
            except Exception as e:  # detokenizing or stop handling: this request's alone
                self._fail(req, e)
        self._refresh_gauges()
        return advanced

    def _fail(self, req: Request, e: Exception) -> None:
        log.exception("request %s failed", req.request_id, exc_info=e)
        self._emit(req, [], "", finish_reason="abort", error=f"{type(e).__name__}: {e}", error_code=500)

    def _refresh_gauges(self) -> None:
        if self.metrics:
            s = self.scheduler
            self.metrics.running.set(len(s.running))
            self.metrics.waiting.set(len(s.waiting))
            self.metrics.kv_usage.set(s.kv.usage())
            self.metrics.engine_dead.set(self.dead is not None)
            self.metrics.preemptions.inc(s.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = s.num_preemptions

    def _append(self, req: Request, tok: int, now: float, logprob=None) -> None:
        if self.metrics:
            m = self.metrics
            m.generation_tokens.inc()
            if req.first_token_time is None:
                m.ttft.observe(now - req.arrival)
                m.prompt_tokens.inc(len(req.prompt_ids))
            else:
                m.itl.observe(now - req.last_token_time)
        req.first_token_time = req.first_token_time or now
        req.last_token_time = now
        req.output_ids.append(tok)
        reason, stop_reason = None, None
        if not req.ignore_eos and tok in self.eos_ids:
            reason = "stop"
        elif tok in req.params.stop_token_ids:
            reason, stop_reason = "stop", tok
        elif len(req.output_ids) >= req.max_tokens or req.num_tokens >= self.max_model_len:
            reason = "length"
        text = ""
        if req.detok is not None:
            req.detok.push(tok)
            full = req.detok.text
            check = req.stop and len(req.output_ids) >= req.params.min_tokens
            hit = find_stop(full, req.stop, req.text_sent) if check else None
            if hit is not None:
                stop_reason = next(s for s in req.stop if full.startswith(s, hit))
                reason, full = "stop", full[:hit]
            elif reason is not None:
                full = full + req.detok.flush()
            held = 0 if reason else max((len(s) - 1 for s in req.stop), default=0)
            end = max(req.text_sent, len(full) - held)
            text, req.text_sent = full[req.text_sent : end], end
        self._emit(req, [tok], text, reason, stop_reason, logprobs=None if logprob is None else [logprob])

    def _emit(
        self,
        req: Request,
        toks: list[int],
        text: str,
        finish_reason: str | None = None,
        stop_reason=None,
        error: str | None = None,
        error_code: int = 503,
        logprobs=None,
    ) -> None:
        finished = finish_reason is not None
        if finished:
            self._requests.pop(req.request_id, None)
            self.scheduler.finish(req)
            self.sampler.forget(req.request_id)
            if self.metrics and error is None:
                self.metrics.success(finish_reason).inc()
                self.metrics.e2e.observe(time.monotonic() - req.arrival)
        req.on_output(
            RequestOutput(
                req.request_id,
                toks,
                text,
                finished,
                finish_reason,
                stop_reason,
                len(req.prompt_ids),
                len(req.output_ids),
                error,
                error_code,
                logprobs,
            )
        )
