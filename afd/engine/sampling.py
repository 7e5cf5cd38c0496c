"""Token sampling: greedy, temperature, top-k, top-p, each request with its own optional seed."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# vLLM bounds seeds to torch.long; a generator refuses what does not fit 64 bits.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass
class SamplingParams:
    temperature: float = 0.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 means no top-k cut."""
    seed: int | None = None

    def __post_init__(self):
        for name in ("temperature", "top_p"):
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


class Sampler:
    """Keeps one generator per seeded request so that a seed reproduces its tokens across steps."""

    def __init__(self):
        self._generators: dict[object, torch.Generator] = {}

    def forget(self, request_id: object) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list) -> list[int]:
        """logits [B, V] fp32 -> one token id per row."""
        out = logits.argmax(dim=-1).tolist()
        for b, p in enumerate(params):
            if p.temperature > 0:
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
