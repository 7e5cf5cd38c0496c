"""The FFN half of DeepSeek-V3: per MoE layer, the router and the routed experts this node holds.

Routing follows HF's DeepseekV3TopkRouter exactly (noaux_tc): fp32 sigmoid scores (classifier and
correction bias stay fp32 at the checkpoint's precision in a bf16 model, as HF keeps them); the bias
steers the choice only; experts split into G groups, each scored by the sum of its top-2 biased
scores; the best topk_group groups stay; top-K over their experts; weights = the unbiased scores of
the chosen, normalised if norm_topk_prob, times routed_scaling_factor. Where the backend has this
math as one fused op (Backend.moe_gating_top_k: npu_moe_gating_top_k on NPU, with norm_topk_prob), it runs.
Shapes: T tokens, H hidden, E routed experts, G groups, K top-k.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from afd.backend import Backend
from afd.model import halves
from afd.model.deepseek_v3.config import DeepseekV3Config
from afd.model.experts import Experts
from afd.model.layers import read_directly


class Router(nn.Module):
    e_score_correction_bias: torch.Tensor

    def __init__(self, cfg: DeepseekV3Config):
        super().__init__()
        E = cfg.n_routed_experts
        self.classifier = read_directly(nn.Linear(cfg.hidden_size, E, bias=False))
        self.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.top_k, self.scale, self.norm = cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.norm_topk_prob
        self.groups, self.keep_groups = cfg.n_group, cfg.topk_group

    def forward(self, x: torch.Tensor, backend: Backend | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> weights [T, K] (fp32), ids [T, K]; through `backend`'s fused op where it has one."""
        T, E, G = x.shape[0], self.classifier.weight.shape[0], self.groups
        logits = F.linear(x.float(), self.classifier.weight.float())  # [T, E]
        if backend is not None:
            fused = backend.moe_gating_top_k(
                logits,
                self.top_k,
                bias=self.e_score_correction_bias.float(),
                sigmoid=True,
                groups=G,
                keep_groups=self.keep_groups,
                renormalise=self.norm,
                scale=self.scale,
            )
            if fused is not None:
                return fused
        scores = logits.sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias  # [T, E]
        group_scores = choice.view(T, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        best = group_scores.topk(self.keep_groups, dim=-1, sorted=False)[1]  # [T, topk_group]
        kept = torch.zeros_like(group_scores).scatter_(1, best, 1)
        kept = kept.unsqueeze(-1).expand(T, G, E // G).reshape(T, E).bool()  # [T, E]
        ids = choice.masked_fill(~kept, float("-inf")).topk(self.top_k, dim=-1, sorted=False)[1]  # [T, K]
        weights = scores.gather(1, ids)
        if self.norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class FFNLayer(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, held: tuple[int, ...]):
        super().__init__()
        self.router = Router(cfg)
        # DeepSeek has no identity experts: nothing for a holder to serve beyond its routed ones.
        self.experts = Experts(
            cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, held, serves_zero=False
        )


class FFNHalf(halves.FFNHalf):
    """The MoE layers of the model (cfg.moe_layers), holding the routed experts `experts` (all by default).
    With `mtp`, also the MTP module's MoE layer (afd.model.deepseek_v3.mtp), as layer num_hidden_layers."""

    cfg: DeepseekV3Config
    # HF's `_keep_in_fp32_modules_strict` (`gate.weight`, `e_score_correction_bias`): the whole router
    keep_in_fp32_strict = ("router.classifier.weight", "router.e_score_correction_bias")

    def __init__(self, cfg: DeepseekV3Config, experts=None, serves_zero: bool = True, mtp: bool = False):
        super().__init__(cfg, experts, serves_zero)
        self.mtp_layers = cfg.mtp_moe_layers if mtp else ()
        served = cfg.moe_layers + self.mtp_layers
        self.layers = nn.ModuleList([FFNLayer(cfg, self.held) for _ in served])
        self._index = {layer: k for k, layer in enumerate(served)}

    def layer(self, i: int) -> FFNLayer:
        """Decoder layer i's MoE (router and experts): what metrics and weight prefetch read."""
        return cast(FFNLayer, self.layers[self._index[i]])  # nn.ModuleList's items are typed Module

    def forward(self, backend: Backend, i: int, m: torch.Tensor) -> torch.Tensor:
        """Routed experts of decoder layer i on m [T, H] (this node's experts only)."""
        layer = self.layer(i)
        weights, ids = layer.router(m, backend)
        return layer.experts(backend, m, weights, ids)
