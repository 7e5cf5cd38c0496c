"""From sampled tokens to what each request's caller receives: the output processor.

Per token a request emits it appends the token, advances the request's grammar (structured outputs: a
complete grammar ends the request, finish_reason stop), checks the stops that need no text (EOS unless
ignore_eos, stop_token_ids, max_tokens and the context length), detokenizes incrementally, looks for
stop strings (cutting the text before one), holds back the text a stop string may still start with, and
hands a `RequestOutput` delta to the request's `on_output`. A finished request leaves the scheduler and
the sampler here too. It keeps the requests that have not finished (`requests`), as the engine counts
them; what the engine's metrics count comes back as `Counts`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from afd.engine.messages import SampledStep, StepPlan
from afd.engine.request import Request, RequestOutput, Status
from afd.engine.sampling import Sampler
from afd.engine.scheduler import Scheduler
from afd.engine.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop

log = logging.getLogger("afd.engine")


@dataclass(frozen=True, slots=True)
class Finished:
    reason: str
    """stop, length or abort."""
    seconds: float
    """Since the request arrived."""


@dataclass(slots=True)
class Counts:
    """What the processor did that the engine's metrics count (requests that end with an error are
    not counted)."""

    tokens: int = 0
    prompt_tokens: int = 0
    """Of the requests whose first token came."""
    first_token_seconds: list[float] = field(default_factory=list)
    inter_token_seconds: list[float] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Stop:
    reason: str | None = None
    """stop or length; None while the request goes on."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended it."""


class OutputProcessor:
    def __init__(
        self,
        scheduler: Scheduler,
        sampler: Sampler,
        tokenizer: Tokenizer | None,
        eos_ids: tuple[int, ...],
        max_model_len: int,
    ):
        self.scheduler, self.sampler, self.tokenizer = scheduler, sampler, tokenizer
        self.eos_ids, self.max_model_len = eos_ids, max_model_len
        self.requests: dict[str, Request] = {}
        """The requests that have not finished, by id."""

    def add(self, req: Request) -> bool:
        """Tracks a new request; False when it failed at once (its detokenizer could not start)."""
        self.requests[req.request_id] = req
        try:
            if self.tokenizer is not None:
                req.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, req.skip_special_tokens)
        except Exception as e:
            self.fail(req, e)
            return False
        return True

    def process(self, plan: StepPlan, sampled: SampledStep, logits: torch.Tensor, now: float) -> Counts:
        """The step's tokens and logprobs (per plan entry, as afd.engine.sampling.sample_step gives them;
        logits: the runner's, now: when they came), to each request's caller. What fails for one request
        (detokenizing, stop handling) fails that request alone."""
        counts = Counts()
        for s, row, toks, lps in zip(plan, plan.logit_rows(), sampled.tokens, sampled.logprobs):
            if toks is None:
                continue
            req = s.request
            try:
                for j, tok in enumerate(toks):
                    if req.status is Status.FINISHED:  # EOS, a stop or the length limit came first
                        break
                    if req.logits is not None:
                        req.logits.append(logits[row + j].clone())
                    self._append(req, tok, now, None if lps is None else lps[j], counts)
            except Exception as e:
                self.fail(req, e)
        return counts

    def abort(self, req: Request, error: str | None = None, error_code: int = 503) -> Counts:
        """Ends the request with finish_reason abort (and `error`, when the engine failed it)."""
        counts = Counts()
        self._emit(req, [], "", _Stop("abort"), counts, error=error, error_code=error_code)
        return counts

    def fail(self, req: Request, e: Exception) -> None:
        """This request alone failed (HTTP 500 with the reason)."""
        log.exception("request %s failed", req.request_id, exc_info=e)
        self.abort(req, f"{type(e).__name__}: {e}", 500)

    # ---- one token ----------------------------------------------------------------------------------------

    def _append(self, req: Request, tok: int, now: float, logprob, counts: Counts) -> None:
        counts.tokens += 1
        if req.first_token_time is None:
            counts.first_token_seconds.append(now - req.arrival)
            counts.prompt_tokens += len(req.prompt_ids)
        elif req.last_token_time is not None:
            counts.inter_token_seconds.append(now - req.last_token_time)
        req.first_token_time = req.first_token_time or now
        req.last_token_time = now
        req.output_ids.append(tok)
        stop = self._token_stop(req, tok)
        if req.grammar is not None and stop.reason != "stop" and req.grammar.advance(tok):
            stop = _Stop("stop")  # complete (before max_tokens, or at it: the text is whole, so not length)
        stop, text = self._text(req, stop)
        self._emit(req, [tok], text, stop, counts, logprobs=None if logprob is None else [logprob])

    def _token_stop(self, req: Request, tok: int) -> _Stop:
        """The stops a token id decides: EOS, a stop token id, max_tokens or the context length."""
        if not req.ignore_eos and tok in self.eos_ids:
            return _Stop("stop")
        if tok in req.params.stop_token_ids:
            return _Stop("stop", tok)
        if len(req.output_ids) >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return _Stop("length")
        return _Stop()

    def _text(self, req: Request, stop: _Stop) -> tuple[_Stop, str]:
        """The new text to hand out, and the stop with stop strings checked: the text ends before a stop
        string, and while none has ended it, the last len(longest stop) - 1 characters wait."""
        detok = req.detok
        if detok is None:
            return stop, ""
        detok.push(req.output_ids[-1])
        full = detok.text
        check = req.stop and len(req.output_ids) >= req.params.min_tokens
        hit = find_stop(full, req.stop, req.text_sent) if check else None
        if hit is not None:
            stop = _Stop("stop", next(s for s in req.stop if full.startswith(s, hit)))
            full = full[:hit]
        elif stop.reason is not None:
            full = full + detok.flush()
        held = 0 if stop.reason else max((len(s) - 1 for s in req.stop), default=0)
        end = max(req.text_sent, len(full) - held)
        text, req.text_sent = full[req.text_sent : end], end
        return stop, text

    def _emit(
        self,
        req: Request,
        toks: list[int],
        text: str,
        stop: _Stop,
        counts: Counts,
        error: str | None = None,
        error_code: int = 503,
        logprobs: list | None = None,
    ) -> None:
        finished = stop.reason is not None
        if stop.reason is not None:
            self.requests.pop(req.request_id, None)
            self.scheduler.finish(req)
            self.sampler.forget(req.request_id)
            if error is None:
                counts.finished.append(Finished(stop.reason, time.monotonic() - req.arrival))
        req.on_output(
            RequestOutput(
                req.request_id,
                toks,
                text,
                finished,
                stop.reason,
                stop.stop_reason,
                len(req.prompt_ids),
                len(req.output_ids),
                error,
                error_code,
                logprobs,
            )
        )
