"""FFN-side weight prefetch in the communication gaps (docs/design/longcat-on-ascend.md#ffn-prefetch).

While an FFN node waits for layer l's hidden states it hints the weights that layer will read first,
then the next layer's router and first GEMM, until a byte budget is spent. The schedule sits beside
the serving loop (FFNServer calls it as its layer hook); what a hint does is the backend's business:
`npu_prefetch` into L2 on Ascend, a cache-warming read on CPU, nothing on CUDA (see afd/backend).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from afd.backend import Backend
from afd.model.halves import FFNHalf

WEIGHTS = ("router", "gate_up", "down")


@dataclass(frozen=True)
class PrefetchConfig:
    enabled: bool | None = None
    """None: the backend's default (on only where the benchmark suite showed a gain)."""
    budget_bytes: int = 8 << 20
    """Bytes hinted per wait."""
    weights: tuple[str, ...] = WEIGHTS
    """Which of the layer's weights, in order: router, gate_up (first GEMM), down (second GEMM)."""
    next_layer: bool = True
    """After layer l's weights, also layer l+1's router and first GEMM."""

    def __post_init__(self):
        bad = [w for w in self.weights if w not in WEIGHTS]
        if bad:
            raise ValueError(f"prefetch.weights: unknown {bad}; choose from {', '.join(WEIGHTS)}")
        if self.budget_bytes <= 0:
            raise ValueError(f"prefetch.budget_bytes must be positive, got {self.budget_bytes}")

    def active(self, backend: Backend) -> bool:
        return backend.prefetch_by_default if self.enabled is None else self.enabled


def _tensors(ffn: FFNHalf, layer: int, names) -> list[torch.Tensor]:
    lay: Any = ffn.layer(layer)  # the family's MoE layer: router.classifier and experts (FFNHalf.layer)
    by_name = {"router": lay.router.classifier.weight, "gate_up": lay.experts.w13, "down": lay.experts.w2}
    return [by_name[n] for n in names]


class PrefetchSchedule:
    def __init__(self, ffn: FFNHalf, backend: Backend, cfg: PrefetchConfig):
        self.backend, self.cfg = backend, cfg
        moe = ffn.cfg.moe_layers
        self.plan: dict[int, list[torch.Tensor]] = {}
        for k, layer in enumerate(moe):
            items = _tensors(ffn, layer, cfg.weights)
            if cfg.next_layer and k + 1 < len(moe):
                items += _tensors(ffn, moe[k + 1], [w for w in ("router", "gate_up") if w in cfg.weights])
            self.plan[layer] = items
        self.bytes_total = 0

    def __call__(self, layer: int) -> int:
        """Hints layer `layer`'s plan up to the budget; returns the bytes hinted."""
        left = self.cfg.budget_bytes
        for t in self.plan[layer]:
            if left <= 0:
                break
            left -= self.backend.prefetch(t, left)
        done = self.cfg.budget_bytes - max(left, 0)
        self.bytes_total += done
        return done
