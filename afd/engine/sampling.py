"""Token sampling: penalties, logit bias and min_tokens (afd.engine.logits), then greedy or temperature
with top-k / top-p, each request with its own optional seed."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from afd.backend import host_syncs
from afd.backend.base import to_device
from afd.engine.logits import History, process

if TYPE_CHECKING:
    from afd.engine.messages import StepPlan
    from afd.engine.request import Request

# vLLM bounds seeds to torch.long; a generator refuses what does not fit 64 bits.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20
"""Top logprobs per token a request may ask for (OpenAI's cap)."""
GREEDY_BELOW = 1e-5
"""Temperatures under this are greedy, as in vLLM: dividing logits by 1e-172 overflows to inf."""


@dataclass
class SamplingParams:
    temperature: float = 0.0
    """0 (or anything below GREEDY_BELOW) means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 means no top-k cut."""
    seed: int | None = None
    presence_penalty: float = 0.0
    """OpenAI: subtracted from the logit of every token the output already holds (-2..2)."""
    frequency_penalty: float = 0.0
    """OpenAI: subtracted once per occurrence in the output (-2..2)."""
    repetition_penalty: float = 1.0
    """HF / vLLM: logits of tokens in prompt or output divided (if > 0) or multiplied by it (> 0)."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Token id -> added to its logit (-100..100)."""
    min_tokens: int = 0
    """EOS and stop_token_ids are barred (and stop strings not checked) until this many tokens exist."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the request (finish_reason stop, stop_reason the id); they stay in the output."""
    logprobs: int | None = None
    """Return each sampled token's logprob and this many top alternatives (None: no logprobs)."""

    def __post_init__(self):
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise ValueError(f"seed must be in [{INT64_MIN}, {INT64_MAX}], got {self.seed}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for tok, bias in self.logit_bias.items():
            if not isinstance(tok, int) or tok < 0:
                raise ValueError(f"logit_bias: token id {tok!r} must be a non-negative integer")
            if not (isinstance(bias, (int, float)) and math.isfinite(bias) and -100 <= bias <= 100):
                raise ValueError(f"logit_bias: the bias of token {tok} must be in [-100, 100], got {bias!r}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def processes_logits(self) -> bool:
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )


class Sampler:
    """Keeps one generator per seeded request so that a seed reproduces its tokens across steps."""

    def __init__(self, eos_ids: tuple[int, ...] = ()):
        self.eos_ids = eos_ids
        self._generators: dict[object, torch.Generator] = {}

    def forget(self, request_id: object) -> None:
        self._generators.pop(request_id, None)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        request_ids: list,
        histories: list[History] | None = None,
    ) -> list[int]:
        """logits [B, V] fp32 -> one token id per row. `histories` (prompt and output ids per row) are
        needed when a request asks for penalties or min_tokens."""
        rows = [b for b, p in enumerate(params) if p.processes_logits]
        if rows:
            if histories is None:
                raise ValueError("penalties and min_tokens need each row's history")
            logits = logits.clone()
            for b in rows:
                logits[b] = process(logits[b], params[b], histories[b], self.eos_ids)
        out = host_syncs.to_list(logits.argmax(dim=-1))
        for b, p in enumerate(params):
            if p.temperature >= GREEDY_BELOW:
                out[b] = self._sample_row(logits[b], p, request_ids[b])
        return out

    def _sample_row(self, logits: torch.Tensor, p: SamplingParams, rid) -> int:
        return int(torch.multinomial(self._probs(logits, p), 1, generator=self._generator(rid, p)))

    def _probs(self, logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """The distribution a token is drawn from: temperature, then top-k and top-p, [V] on the CPU
        (one row is cheap to move, and the per-request generators live there)."""
        # An extreme repetition penalty (1e-270) or a small temperature can overflow a logit to +inf,
        # and softmax over +inf is NaN; the largest finite float keeps the limit (those tokens tie).
        host_syncs.note(logits.device)
        logits = (logits.float().cpu() / p.temperature).clamp(max=torch.finfo(torch.float32).max)
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # always keeps the most likely token
            probs = torch.zeros_like(probs).scatter_(0, idx[keep], sorted_p[keep])
        return probs

    def _generator(self, rid, p: SamplingParams) -> torch.Generator | None:
        if p.seed is None:
            return None
        gen = self._generators.get(rid)
        if gen is None:
            gen = self._generators[rid] = torch.Generator().manual_seed(p.seed)
        return gen

    def verify(self, logits: torch.Tensor, drafts: list[int], p: SamplingParams, rid, history: History) -> list[int]:
        """Speculative decoding: logits [d + 1, V] of a request's last token and its d draft tokens ->
        the tokens it emits: the accepted drafts, then one more (the target's correction at the first
        rejected draft, or a bonus token after the last). Row j is processed with the tokens before it
        (penalties, min_tokens). Greedy keeps a draft iff it is the argmax, so the tokens are those of
        decoding one at a time; sampling follows the rejection rule (`rejection_sample`), so their
        distribution is too. Drafts are the MTP head's argmax: q is one-hot at the draft."""
        out: list[int] = []
        for j in range(len(drafts) + 1):
            row = logits[j]
            if p.processes_logits:
                row = process(row, p, History(history.prompt_ids, history.output_ids + out), self.eos_ids)
            if p.temperature < GREEDY_BELOW:
                out.append(host_syncs.to_int(row.argmax()))
                if j < len(drafts) and out[-1] == drafts[j]:
                    continue
                return out
            probs, gen = self._probs(row, p), self._generator(rid, p)
            if j == len(drafts):
                return out + [int(torch.multinomial(probs, 1, generator=gen))]
            q = torch.zeros_like(probs)
            q[drafts[j]] = 1.0  # the draft distribution: one-hot at the MTP head's argmax
            tok, kept = rejection_sample(probs, q, drafts[j], gen)
            out.append(tok)
            if not kept:
                return out
        return out


def rejection_sample(p: torch.Tensor, q: torch.Tensor, draft: int, gen: torch.Generator | None) -> tuple[int, bool]:
    """Speculative sampling's rule (Leviathan et al. 2023; Chen et al. 2023) for a draft x ~ q [V] checked
    against the target p [V]: keep x with probability min(1, p(x) / q(x)), else draw from
    normalize(max(0, p - q)). The token returned is distributed as p, whatever q is. Returns (token, kept)."""
    u = float(torch.rand((), generator=gen))
    if u * float(q[draft]) < float(p[draft]):
        return draft, True
    residual = (p - q).clamp_min(0)
    if float(residual.sum()) <= 0:  # only by rounding: a rejection needs p(x) < q(x), so p > q somewhere
        residual = p
    return int(torch.multinomial(residual / residual.sum(), 1, generator=gen)), False


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The sampled token's logprob and the k most likely (id, logprob) under the model's raw
    distribution (vLLM's default: before penalties and temperature)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    host_syncs.note(lp.device, 2 if k else 1)
    top = torch.topk(lp, k) if k else None
    alts = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
    return float(lp[token]), alts


Fail = Callable[["Request", Exception], None]


def sample_step(sampler: Sampler, plan: StepPlan, logits: torch.Tensor, fail: Fail) -> list[list[int] | None]:
    """Per entry of the plan, the tokens its request emits: one, or with drafts to verify (its logits
    rows row .. row + d) the accepted ones and one more (Sampler.verify); None for a prefill chunk that
    samples nothing. A request whose sampling raises goes to `fail(req, error)` alone and gets None; the
    others still get their tokens."""
    rows = plan.logit_rows()
    out: list[list[int] | None] = [None] * len(plan)
    plain = [k for k, s in enumerate(plan.seqs) if s.samples and not s.drafts]
    if plain:
        toks = _sample_each(sampler, logits, [rows[k] for k in plain], [plan.seqs[k].request for k in plain], fail)
        for k, tok in zip(plain, toks):
            out[k] = None if tok is None else [tok]
    for k, s in enumerate(plan.seqs):
        if not s.drafts:
            continue
        req = s.request
        try:
            out[k] = sampler.verify(
                logits[rows[k] : rows[k] + len(s.drafts) + 1],
                list(s.drafts),
                req.params,
                req.request_id,
                History(req.prompt_ids, req.output_ids),
            )
        except Exception as e:
            fail(req, e)
    return out


def _take_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows]: a slice where the rows are consecutive (the usual case), else a gather whose index is
    staged without a host sync (a list index is a blocking copy)."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return logits[rows[0] : rows[0] + len(rows)]
    return logits[to_device(torch.tensor(rows), logits.device)]


def _sample_each(
    sampler: Sampler, logits: torch.Tensor, rows: list[int], reqs: list[Request], fail: Fail
) -> list[int | None]:
    """One token per request, all in one batch; if that raises, one by one, so that only the request whose
    sampling raises fails (None)."""
    try:
        return list(  # list[int] as list[int | None]
            sampler.sample(
                _take_rows(logits, rows),
                [r.params for r in reqs],
                [r.request_id for r in reqs],
                [History(r.prompt_ids, r.output_ids) for r in reqs],
            )
        )
    except Exception:
        out: list[int | None] = []
        for row, req in zip(rows, reqs):
            try:
                out.append(
                    sampler.sample(
                        logits[[row]], [req.params], [req.request_id], [History(req.prompt_ids, req.output_ids)]
                    )[0]
                )
            except Exception as e:
                fail(req, e)
                out.append(None)
        return out
