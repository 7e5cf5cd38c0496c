"""Token sampling: penalties, logit bias and min_tokens (afd.engine.logits), then greedy or temperature
with top-k / top-p, each request with its own optional seed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from afd.engine.logits import History, process

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
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)


class Sampler:
    """Keeps one generator per seeded request so that a seed reproduces its tokens across steps."""

    def __init__(self, eos_ids: tuple[int, ...] = ()):
        self.eos_ids = eos_ids
        self._generators: dict[object, torch.Generator] = {}

    def forget(self, request_id: object) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list,
               histories: list[History] | None = None) -> list[int]:
        """logits [B, V] fp32 -> one token id per row. `histories` (prompt and output ids per row) are
        needed when a request asks for penalties or min_tokens."""
        rows = [b for b, p in enumerate(params) if p.processes_logits]
        if rows:
            logits = logits.clone()
            for b in rows:
                logits[b] = process(logits[b], params[b], histories[b], self.eos_ids)
        out = logits.argmax(dim=-1).tolist()
        for b, p in enumerate(params):
            if p.temperature >= GREEDY_BELOW:
                out[b] = self._sample_row(logits[b], p, request_ids[b])
        return out

    def _sample_row(self, logits: torch.Tensor, p: SamplingParams, rid) -> int:
        # on the CPU: one row is cheap to move, and the per-request generators live there
        logits = logits.float().cpu() / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # always keeps the most likely token
            probs = torch.zeros_like(probs).scatter_(0, idx[keep], sorted_p[keep])
        gen = None
        if p.seed is not None:
            gen = self._generators.get(rid)
            if gen is None:
                gen = self._generators[rid] = torch.Generator().manual_seed(p.seed)
        return int(torch.multinomial(probs, 1, generator=gen))


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The sampled token's logprob and the k most likely (id, logprob) under the model's raw
    distribution (vLLM's default: before penalties and temperature)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(lp, k) if k else None
    alts = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
    return float(lp[token]), alts
