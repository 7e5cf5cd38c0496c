"""The FFN half of LongCat-Flash: per layer, the router and the experts this node holds.

Routing follows HF exactly: an fp32 classifier over E = n_routed + n_zero outputs, softmax, top-K on
softmax + e_score_correction_bias, weights = softmax[idx] * routed_scaling_factor. Routed experts run as
grouped GEMMs over tokens sorted by expert; ids >= n_routed are identity experts that add w * x.
Shapes: T tokens, H hidden, I expert intermediate, E router outputs, K top-k, G local routed experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from afd.backend import Backend
from afd.config import ModelConfig


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E = cfg.num_experts_total
        self.classifier = nn.Linear(cfg.hidden_size, E, bias=cfg.router_bias)
        self.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.top_k, self.scale = cfg.moe_topk, cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> weights [T, K] (fp32), ids [T, K]."""
        w = self.classifier.weight.float()
        b = None if self.classifier.bias is None else self.classifier.bias.float()
        scores = F.linear(x.float(), w, b).softmax(dim=-1)  # [T, E]
        ids = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1, sorted=False)[1]
        return scores.gather(1, ids) * self.scale, ids


class Experts(nn.Module):
    """Stacked weights of routed experts [lo, lo + G): w13 [G, H, 2I] (gate | up), w2 [G, I, H]."""

    def __init__(self, cfg: ModelConfig, lo: int, hi: int, serves_zero: bool):
        super().__init__()
        G, H, I = hi - lo, cfg.hidden_size, cfg.expert_ffn_hidden_size
        self.lo, self.hi, self.n_routed, self.serves_zero = lo, hi, cfg.n_routed_experts, serves_zero
        self.w13 = nn.Parameter(torch.empty(G, H, 2 * I))
        self.w2 = nn.Parameter(torch.empty(G, I, H))
        self.last_counts: list[int] = [0] * G
        """Tokens each local expert got in the last call (read by the FFN node's metrics)."""

    def forward(self, backend: Backend, x, weights, ids) -> torch.Tensor:
        """x [T, H], weights/ids [T, K] -> this node's share of the MoE output [T, H]."""
        T, K = ids.shape
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)  # [T*K]
        local = (flat >= self.lo) & (flat < self.hi)
        sel = local.nonzero().squeeze(1)
        order = sel[torch.argsort(flat[sel], stable=True)]  # (token, k) slots sorted by expert
        sizes = torch.bincount(flat[order] - self.lo, minlength=self.hi - self.lo).tolist()
        self.last_counts = sizes
        if order.numel():
            token = order // K
            gate, up = backend.grouped_matmul(x[token], self.w13, sizes).chunk(2, dim=-1)  # [N, I] each
            y = backend.grouped_matmul(F.silu(gate) * up, self.w2, sizes)  # [N, H]
            out.index_add_(0, token, (y * weights.reshape(-1)[order, None]).to(x.dtype))
        if self.serves_zero:
            zero_w = (weights * (ids >= self.n_routed)).sum(dim=-1, keepdim=True)  # [T, 1]
            out += (x * zero_w).to(x.dtype)
        return out


class FFNLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, lo: int, hi: int, serves_zero: bool):
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg, lo, hi, serves_zero)


class FFNHalf(nn.Module):
    """All MoE layers of the model, holding routed experts [lo, hi) (all of them by default)."""

    def __init__(self, cfg: ModelConfig, lo: int = 0, hi: int | None = None, serves_zero: bool = True):
        super().__init__()
        hi = cfg.n_routed_experts if hi is None else hi
        if not 0 <= lo <= hi <= cfg.n_routed_experts:
            raise ValueError(f"expert range [{lo}, {hi}) outside [0, {cfg.n_routed_experts})")
        self.cfg, self.expert_range, self.serves_zero = cfg, (lo, hi), serves_zero
        self.layers = nn.ModuleList([FFNLayer(cfg, lo, hi, serves_zero) for _ in range(cfg.num_layers)])

    def forward(self, backend: Backend, i: int, m: torch.Tensor) -> torch.Tensor:
        """MoE of layer i on m [T, H] (this node's experts only)."""
        layer = self.layers[i]
        weights, ids = layer.router(m)
        return layer.experts(backend, m, weights, ids)
