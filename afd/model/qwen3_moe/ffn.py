"""The FFN half of Qwen3-MoE: per sparse layer, the router and the experts this node holds.

Routing follows HF's Qwen3MoeTopKRouter: logits in the model dtype, softmax over E in fp32, top-K,
renormalised over the K when `norm_topk_prob`, then cast back to the model dtype. No identity experts.
Shapes: T tokens, H hidden, E experts, K top-k.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from afd.backend import Backend
from afd.model import halves
from afd.model.experts import Experts
from afd.model.layers import read_directly
from afd.model.qwen3_moe.config import Qwen3MoeConfig


class Router(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig):
        super().__init__()
        self.classifier = read_directly(nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False))
        self.top_k, self.renormalise = cfg.num_experts_per_tok, cfg.norm_topk_prob

    # No fused op (Backend.moe_gating_top_k): npu_moe_gating_top_k's softmax mode does not renormalise the K
    # weights, and it returns them in the logits' dtype, so renormalising its output would divide rounded bf16
    # values where HF divides the fp32 ones. Without norm_topk_prob it would fit (not wired: Qwen3-30B-A3B and
    # Qwen3-235B-A22B, the released Qwen3-MoE checkpoints, set it).
    def forward(self, x: torch.Tensor, backend: Backend | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> weights [T, K] (x's dtype), ids [T, K]. `backend`: the routers' common signature (the
        attention side passes it, afd.dataplane.dispatch); unused, see above."""
        probs = F.linear(x, self.classifier.weight).softmax(dim=-1, dtype=torch.float32)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, K]
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids


class FFNLayer(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, held: tuple[int, ...]):
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, held, serves_zero=False)


class FFNHalf(halves.FFNHalf):
    """The sparse layers (cfg.moe_layers) of the model, holding the routed experts `experts` (all by default).

    `serves_zero` is accepted for the family contract; Qwen3-MoE has no identity experts to serve."""

    cfg: Qwen3MoeConfig

    def __init__(self, cfg: Qwen3MoeConfig, experts=None, serves_zero: bool = True):
        super().__init__(cfg, experts, serves_zero=False)
        self.index = {layer: k for k, layer in enumerate(cfg.moe_layers)}
        """Decoder layer -> its position in `layers`: dense layers hold nothing here."""
        self.layers = nn.ModuleList([FFNLayer(cfg, self.held) for _ in cfg.moe_layers])

    def routed(
        self, backend: Backend, i: int, m: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        # the router's weights are in m's dtype (HF's): they cross as float32, exactly, and go back to it here
        return super().routed(backend, i, m, weights.to(m.dtype), ids)

    def layer(self, i: int) -> FFNLayer:
        """Decoder layer i's MoE (router and experts): what metrics and weight prefetch read."""
        return cast(FFNLayer, self.layers[self.index[i]])  # nn.ModuleList's items are typed Module

    def forward(self, backend: Backend, i: int, m: torch.Tensor) -> torch.Tensor:
        """MoE of decoder layer i on m [T, H] (this node's experts only)."""
        layer = self.layer(i)
        weights, ids = layer.router(m)
        return layer.experts(backend, m, weights, ids)
