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


class Experts(nn.Module):
    """Stacked weights of routed experts [lo, lo + G): w13 [G, H, 2I] (gate | up), w2 [G, I, H].

    Router ids >= n_routed are identity experts; `serves_zero` says whether this holder adds them."""

    def __init__(self, hidden: int, inter: int, n_routed: int, lo: int, hi: int, serves_zero: bool):
        super().__init__()
        G, H, I = hi - lo, hidden, inter
        self.lo, self.hi, self.n_routed, self.serves_zero = lo, hi, n_routed, serves_zero
        self.w13 = nn.Parameter(torch.empty(G, H, 2 * I))
        self.w2 = nn.Parameter(torch.empty(G, I, H))
        self.last_counts = torch.zeros(G, dtype=torch.int64)
        """[G] tokens each local expert got in the last call, on the device (the FFN node's metrics add
        them up there and read them once per step)."""
        self.before_gemm: Callable[[torch.Tensor], None] | None = None
        """Called with the group sizes [G] once routing is known, before the grouped GEMMs: the FFN node's
        weight prefetch (afd.dataplane.prefetch) hints the chosen experts' slices there."""

    def forward(self, backend: Backend, x, weights, ids) -> torch.Tensor:
        """x [T, H], weights/ids [T, K] -> this holder's share of the MoE output [T, H]."""
        T, K = ids.shape
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)  # [T*K]
        local = (flat >= self.lo) & (flat < self.hi)
        sel = local.nonzero().squeeze(1)
        order = sel[torch.argsort(flat[sel], stable=True)]  # (token, k) slots sorted by expert
        sizes = torch.bincount(flat[order] - self.lo, minlength=self.hi - self.lo)  # [G], stays on the device
        self.last_counts = sizes
        if self.before_gemm is not None:
            self.before_gemm(sizes)
        if order.numel():
            token = order // K
            gate, up = backend.grouped_matmul(x[token], self.w13, sizes).chunk(2, dim=-1)  # [N, I] each
            y = backend.grouped_matmul(F.silu(gate) * up, self.w2, sizes)  # [N, H]
            out.index_add_(0, token, (y * weights.reshape(-1)[order, None]).to(x.dtype))
        if self.serves_zero:
            zero_w = (weights * (ids >= self.n_routed)).sum(dim=-1, keepdim=True)  # [T, 1]
            out += (x * zero_w).to(x.dtype)
        return out
