"""The FFN half of DeepSeek-V4: per layer, the router and the routed experts this node holds.

Routing is HF's DeepseekV4TopKRouter / DeepseekV4HashRouter: scores = score_fn(gate(m)) (sqrtsoftplus, or
sigmoid); a learned layer picks top-K of scores + e_score_correction_bias (the bias steers the choice only), a
hash layer (mlp_layer_types "hash_moe") takes the K experts tid2eid[token id], a frozen table; either way the
weights are the chosen scores, normalised, times routed_scaling_factor. A hash layer needs the tokens' ids:
the attention half says so (moe_reads_token_ids) and the runner passes them with m. The experts clip their
pre-activations at swiglu_limit (gate above, up both sides). Shapes: T tokens, H hidden, E experts, K top-k.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from afd.backend import Backend
from afd.model import halves
from afd.model.deepseek_v4.config import DeepseekV4Config
from afd.model.experts import Experts
from afd.model.layers import read_directly


class Router(nn.Module):
    e_score_correction_bias: torch.Tensor
    tid2eid: torch.Tensor

    def __init__(self, cfg: DeepseekV4Config, hashed: bool):
        super().__init__()
        E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.hashed, self.top_k, self.scale = hashed, K, cfg.routed_scaling_factor
        self.sqrtsoftplus = cfg.scoring_func == "sqrtsoftplus"
        self.classifier = read_directly(nn.Linear(cfg.hidden_size, E, bias=False))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, K, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(E))

    def forward(
        self, x: torch.Tensor, backend: Backend | None = None, token_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> weights [T, K] (fp32), ids [T, K]. token_ids [T]: needed by a hash layer."""
        logits = F.linear(x, self.classifier.weight)  # [T, E], in x's dtype as HF
        scores = F.softplus(logits).sqrt() if self.sqrtsoftplus else logits.sigmoid()
        if self.hashed:
            if token_ids is None:
                raise RuntimeError("a DeepSeek-V4 hash_moe layer routes by token id, and none came with its input")
            ids = self.tid2eid[token_ids].long()  # [T, K]
        else:
            ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, ids)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return (w * self.scale).float(), ids


class ClippedExperts(Experts):
    """afd's grouped experts with V4's clip on the pre-activations (HF's DeepseekV4Experts._apply_gate)."""

    def __init__(self, cfg: DeepseekV4Config, held: tuple[int, ...]):
        super().__init__(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, held, serves_zero=False)
        self.swiglu_limit = cfg.swiglu_limit


class FFNLayer(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, held: tuple[int, ...], hashed: bool):
        super().__init__()
        self.router = Router(cfg, hashed)
        self.experts = ClippedExperts(cfg, held)


class FFNHalf(halves.FFNHalf):
    """Every layer's MoE (all V4 layers are MoE layers), holding the routed experts `experts` (all by default)."""

    cfg: DeepseekV4Config
    # HF's _keep_in_fp32_modules_strict: e_score_correction_bias
    keep_in_fp32_strict = ("router.e_score_correction_bias",)

    def __init__(self, cfg: DeepseekV4Config, experts=None, serves_zero: bool = True, mtp: bool = False):
        """With `mtp`, also the MTP module's MoE layer (a learned router), as layer num_hidden_layers."""
        super().__init__(cfg, experts, serves_zero)
        self.layers = nn.ModuleList([FFNLayer(cfg, self.held, t == "hash_moe") for t in cfg.mlp_layer_types])
        if mtp:
            self.mtp_layers = (cfg.num_hidden_layers,)
            self.layers.append(FFNLayer(cfg, self.held, False))

    def layer(self, i: int) -> FFNLayer:
        return cast(FFNLayer, self.layers[i])  # nn.ModuleList's items are typed Module

    def forward(self, backend: Backend, i: int, m: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Routed experts of layer i on m [T, H] (this node's experts only); token_ids [T] for a hash layer."""
        layer = self.layer(i)
        weights, ids = layer.router(m, backend, token_ids)
        return layer.experts(backend, m, weights, ids)
