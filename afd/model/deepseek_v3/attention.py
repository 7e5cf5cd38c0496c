"""The attention half of DeepSeek-V3: everything but the routed experts.

Each layer is cut where its MoE input leaves and its routed experts' output returns:

    h = x + attn(ln_in(x));  m = ln_post(h)       # pre_moe: m crosses to the FFN half (MoE layers)
    h = h + shared_experts(m)                     # post_moe: the overlap window
    x = h + y                                     # y = routed experts(m), back from the FFN half

The shared experts need only m, so they run here while the FFN nodes run the routed ones: that is
DeepSeek's overlap window. A dense layer (i < first_k_dense_replace) sends nothing: post_moe adds its
whole MLP and pre_moe returns m = None.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from afd.model import halves
from afd.model.deepseek_v3.config import DeepseekV3Config
from afd.model.layers import DenseMLP, RMSNorm, Rotary, YarnRotary
from afd.model.mla import MLAttention


class SharedExperts(nn.Module):
    """The attention side's part of an MoE layer, named as in the checkpoint (`mlp.shared_experts`)."""

    def __init__(self, cfg: DeepseekV3Config):
        super().__init__()
        self.shared_experts = DenseMLP(cfg.hidden_size, cfg.n_shared_experts * cfg.moe_intermediate_size)

    def forward(self, m: torch.Tensor) -> torch.Tensor:
        return self.shared_experts(m)


class AttentionLayer(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(
            cfg, lora_scales=False, softmax_scale=cfg.softmax_scale, rope_interleave=cfg.rope_interleave
        )
        self.is_moe = i >= cfg.first_k_dense_replace
        self.mlp = SharedExperts(cfg) if self.is_moe else DenseMLP(cfg.hidden_size, cfg.intermediate_size)


def rotary(cfg: DeepseekV3Config) -> Rotary:
    if cfg.rope_type == "default":
        return Rotary(cfg.qk_rope_head_dim, cfg.rope_theta)
    return YarnRotary(
        cfg.qk_rope_head_dim,
        cfg.rope_theta,
        cfg.yarn_factor,
        cfg.yarn_original_max_position_embeddings,
        cfg.rope_beta_fast or 32,
        cfg.rope_beta_slow or 1,
        cfg.rope_attention_scale,
        cfg.rope_truncate is not False,
    )


class AttentionHalf(halves.AttentionHalf):
    """Parameter names follow the HF checkpoint (without its `model.` prefix)."""

    cfg: DeepseekV3Config
    supports_tp = True  # its layers are MLA and dense MLPs

    def __init__(self, cfg: DeepseekV3Config):
        super().__init__(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([AttentionLayer(cfg, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = rotary(cfg)

    def _layer(self, i: int) -> AttentionLayer:
        return cast(AttentionLayer, self.layers[i])  # nn.ModuleList's items are typed Module

    def pre_moe(self, i: int, x, rope, meta, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer i up to the MoE input. kv [num_blocks, block_size, C + R]. Returns (h, m), m None if dense."""
        layer = self._layer(i)
        h = x + layer.self_attn(layer.input_layernorm(x), *rope, meta, kv)
        return h, (layer.post_attention_layernorm(h) if layer.is_moe else None)

    def post_moe(self, i: int, h, m, rope, meta, kv: torch.Tensor) -> torch.Tensor:
        """Layer i's work that does not need the routed experts: the shared experts (the window the
        exchange hides behind), or a dense layer's whole MLP."""
        layer = self._layer(i)
        if m is None:  # dense: no m left the layer; it is made from h here (the half keeps no state)
            m = layer.post_attention_layernorm(h)
        return h + layer.mlp(m)
