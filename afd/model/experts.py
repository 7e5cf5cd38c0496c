"""Routed experts as grouped GEMMs, plus identity (zero-compute) experts: the expert compute any MoE
family's FFN half runs once its router has chosen.

Shapes: T tokens, H hidden, I expert intermediate, K top-k, G routed experts held here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from afd.backend import Backend
from afd.quant.formats import FP8
from afd.quant.scheme import FP8_BLOCK, QuantSpec


class Experts(nn.Module):
    """Stacked weights of the G routed experts `held` (global ids, ascending; weight slot g holds expert
    held[g]): w13 [G, H, 2I] (gate | up), w2 [G, I, H].

    Router ids >= n_routed are identity experts; `serves_zero` says whether this holder adds them. An id
    < 0 is a slot another holder computes (afd.dataplane.dispatch marks them so).
    Quantized (`quantize`, before the weights load), w13 and w2 hold 8-bit weights in the checkpoint's
    orientation, w13 [G, 2I, H] and w2 [G, H, I], with fp32 scales w13_scale [G, 2I, Hb] and w2_scale
    [G, H, Ib] per output channel and K-block (afd.quant.formats)."""

    quant: QuantSpec | None = None
    """The scheme of the quantized weights; None: w13 and w2 in the model dtype."""
    swiglu_limit: float | None = None
    """Clip of the pre-activations (DeepSeek-V4): gate at most this, up within +-this; None: no clip."""
    w13_scale: torch.Tensor
    w2_scale: torch.Tensor

    def __init__(self, hidden: int, inter: int, n_routed: int, held, serves_zero: bool):
        super().__init__()
        self.held: tuple[int, ...] = tuple(held)
        G, H, I = len(self.held), hidden, inter
        self.n_routed, self.serves_zero = n_routed, serves_zero
        self.hidden, self.inter = H, I
        self._slot: torch.Tensor | None = None
        self.w13 = nn.Parameter(torch.empty(G, H, 2 * I))
        self.w2 = nn.Parameter(torch.empty(G, I, H))
        self.last_counts = torch.zeros(G, dtype=torch.int64)
        """[G] tokens each local expert got in the last call, on the device (the FFN node's metrics add
        them up there and read them once per step)."""
        self.last_zero: torch.Tensor | None = None
        """[] identity-expert assignments of the last call where this holder applies them (else None), on
        the device: afd_zero_expert_tokens."""
        self.last_ids: torch.Tensor | None = None
        """[T, K] the router's choice of the last call: graph mode (afd.model.ffn_graph) recounts the two
        above over its real rows, since its padded rows route too."""
        self.before_gemm: Callable[[torch.Tensor], None] | None = None
        """Called with the group sizes [G] once routing is known, before the grouped GEMMs: the FFN node's
        weight prefetch (afd.dataplane.prefetch) hints the chosen experts' slices there."""

    def quantize(self, spec: QuantSpec) -> None:
        """Hold the weights quantized as `spec` says: 8-bit storage replaces w13 and w2, which the loader
        (afd.model.quant_load) fills with their scales. Called on a meta-built half, so the full-precision
        weights are never allocated."""
        G, H, I = len(self.held), self.hidden, self.inter
        dtype = FP8 if spec.weights == FP8_BLOCK else torch.int8
        device = self.w13.device

        def blocks(k: int) -> int:
            return -(-k // spec.block[1]) if spec.weights == FP8_BLOCK else 1

        self.w13 = nn.Parameter(torch.empty(G, 2 * I, H, dtype=dtype, device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(G, H, I, dtype=dtype, device=device), requires_grad=False)
        self.register_buffer("w13_scale", torch.empty(G, 2 * I, blocks(H), device=device))
        self.register_buffer("w2_scale", torch.empty(G, H, blocks(I), device=device))
        self.quant = spec

    def _gemm(self, backend: Backend, x: torch.Tensor, which: str, sizes: torch.Tensor) -> torch.Tensor:
        w = getattr(self, which)
        if self.quant is None:
            return backend.grouped_matmul(x, w, sizes)
        return backend.quant_grouped_matmul(x, w, getattr(self, which + "_scale"), sizes, self.quant)

    def forward(self, backend: Backend, x, weights, ids) -> torch.Tensor:
        """x [T, H], weights/ids [T, K] -> this holder's share of the MoE output [T, H].

        Every (token, k) slot goes through, other holders' too: shapes depend on T and K alone, so nothing
        waits on the host for a count (nonzero and bincount do on a device) and a device graph can hold the
        layer. The grouped GEMM computes only this holder's groups; the other slots sort last and are
        dropped."""
        T, K = ids.shape
        G = len(self.held)
        self.last_ids = ids
        self.last_zero = (ids >= self.n_routed).sum() if self.serves_zero else None
        group = self._group(ids.reshape(-1))  # [T*K]: other holders' slots in group G, after ours
        local = group < G
        order = torch.argsort(group, stable=True)  # [T*K] slots sorted by expert
        ones = torch.ones_like(group)
        sizes = torch.zeros(G + 1, dtype=torch.int64, device=x.device).index_add_(0, group, ones)[:G]  # [G]
        self.last_counts = sizes  # stays on the device
        if self.before_gemm is not None:
            self.before_gemm(sizes)
        token = order // K  # [T*K]
        gate, up = self._gemm(backend, x[token], "w13", sizes).chunk(2, dim=-1)  # [T*K, I] each
        if self.swiglu_limit is not None:
            gate, up = gate.clamp(max=self.swiglu_limit), up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        y = self._gemm(backend, F.silu(gate) * up, "w2", sizes)  # [T*K, H]
        mine = local[order]  # [T*K]
        w = torch.where(mine, weights.reshape(-1)[order], 0.0)  # [T*K]
        y = torch.where(mine[:, None], y * w[:, None], 0.0)  # rows past the groups are unspecified: dropped
        out = torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))
        if self.serves_zero:
            zero_w = (weights * (ids >= self.n_routed)).sum(dim=-1, keepdim=True)  # [T, 1]
            out += (x * zero_w).to(x.dtype)
        return out

    def _group(self, ids: torch.Tensor) -> torch.Tensor:
        """Each slot's weight slot: [0, G) for an expert held here, G for identity experts, other holders'
        experts and the slots another holder computes (ids < 0)."""
        routed = (ids >= 0) & (ids < self.n_routed)
        return torch.where(routed, self.slot(ids.device)[ids.clamp(0, self.n_routed)], len(self.held))

    def slot(self, device: torch.device) -> torch.Tensor:
        """[E + 1]: expert id -> its weight slot, G where not held. Made on first use (not a buffer: the
        loader materialises a meta-built module's buffers from the checkpoint, which has no such tensor)."""
        if self._slot is None or self._slot.device != device:
            G = len(self.held)
            slot = torch.full((self.n_routed + 1,), G, dtype=torch.int64)
            slot[list(self.held)] = torch.arange(G)
            self._slot = slot.to(device)
        return self._slot

    def counts(self, ids: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(last_counts, last_zero) of ids [T, K] counted over the rows where real [T] (bool) holds: a
        graph's padded rows go through the layer, not into the metrics."""
        G = len(self.held)
        group = torch.where(real[:, None], self._group(ids), G).reshape(-1)  # [T*K]: the rest in group G, dropped
        sizes = torch.zeros(G + 1, dtype=torch.int64, device=ids.device).index_add_(0, group, torch.ones_like(group))
        zero = ((ids >= self.n_routed) & real[:, None]).sum() if self.serves_zero else None
        return sizes[:G], zero
