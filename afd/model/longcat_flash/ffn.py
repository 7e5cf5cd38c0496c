"""The FFN half of LongCat-Flash: per layer, the router and the experts this node holds.

Routing follows HF's LongcatFlashTopkRouter exactly: an fp32 classifier over E = n_routed + n_zero
outputs (its bias, when a checkpoint has one, is not applied: HF's forward uses the weight alone),
softmax, top-K on softmax + e_score_correction_bias, weights = softmax[idx] * routed_scaling_factor.
Where the backend has this math as one fused op (Backend.moe_gating_top_k: npu_moe_gating_top_k's softmax
mode on NPU), it runs.
Shapes: T tokens, H hidden, E router outputs, K top-k.
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
from afd.model.longcat_flash.config import LongcatFlashConfig


class Router(nn.Module):
    e_score_correction_bias: torch.Tensor

    def __init__(self, cfg: LongcatFlashConfig):
        super().__init__()
        E = cfg.num_experts_total
        self.classifier = read_directly(nn.Linear(cfg.hidden_size, E, bias=False))
        self.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.top_k, self.scale = cfg.moe_topk, cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor, backend: Backend | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> weights [T, K] (fp32), ids [T, K]; through `backend`'s fused op where it has one."""
        logits = F.linear(x.float(), self.classifier.weight.float())  # [T, E]
        if backend is not None:
            # one group of all E, softmax, no renormalisation: the op's softmax mode is this router's math
            fused = backend.moe_gating_top_k(
                logits,
                self.top_k,
                bias=self.e_score_correction_bias.float(),
                sigmoid=False,
                renormalise=False,
                scale=self.scale,
            )
            if fused is not None:
                return fused
        scores = logits.softmax(dim=-1)  # [T, E]
        ids = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1, sorted=False)[1]
        return scores.gather(1, ids) * self.scale, ids


class FFNLayer(nn.Module):
    def __init__(self, cfg: LongcatFlashConfig, held: tuple[int, ...], serves_zero: bool):
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg.hidden_size, cfg.expert_ffn_hidden_size, cfg.n_routed_experts, held, serves_zero)


class FFNHalf(halves.FFNHalf):
    """All MoE layers of the model, holding the routed experts `experts` (all of them by default)."""

    cfg: LongcatFlashConfig
    keep_in_fp32 = ("router.classifier.weight",)  # HF's `_keep_in_fp32_modules` (`classifier.weight`)

    def __init__(self, cfg: LongcatFlashConfig, experts=None, serves_zero: bool = True):
        super().__init__(cfg, experts, serves_zero)
        self.layers = nn.ModuleList([FFNLayer(cfg, self.held, serves_zero) for _ in range(cfg.num_layers)])

    def layer(self, i: int) -> FFNLayer:
        """Decoder layer i's MoE (router and experts): what metrics and weight prefetch read."""
        return cast(FFNLayer, self.layers[i])  # nn.ModuleList's items are typed Module

    def forward(self, backend: Backend, i: int, m: torch.Tensor) -> torch.Tensor:
        """MoE of decoder layer i on m [T, H] (this node's experts only)."""
        layer = self.layer(i)
        weights, ids = layer.router(m, backend)
        return layer.experts(backend, m, weights, ids)

    def post_load(self) -> None:
        # HF holds the classifier and the correction bias in the model dtype (LongCat's fp32 list is
        # not strict: a bf16 model rounds both to bf16) and upcasts them in the router's forward;
        # upcasting the rounded values once here gives the same fp32 numbers.
        for layer in self.layers:
            layer.router.float()
