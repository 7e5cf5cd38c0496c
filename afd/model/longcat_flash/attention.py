"""The attention half of LongCat-Flash: everything but the shortcut MoE.

Each layer is cut where its MoE input leaves and its MoE output returns:

    h = x + attn0(ln_in0(x));  m = ln_post0(h)          # pre_moe: m crosses to the FFN half
    h = h + mlp0(m); h = h + attn1(ln_in1(h)); h = h + mlp1(ln_post1(h))   # post_moe: the overlap window
    x = h + y                                            # y = MoE(m), back from the FFN half
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from afd.model import halves
from afd.model.layers import DenseMLP, RMSNorm, Rotary
from afd.model.longcat_flash.config import LongcatFlashConfig
from afd.model.mla import MLAttention


class AttentionLayer(nn.Module):
    def __init__(self, cfg: LongcatFlashConfig):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = nn.ModuleList([RMSNorm(cfg.hidden_size, eps) for _ in range(2)])
        self.post_attention_layernorm = nn.ModuleList([RMSNorm(cfg.hidden_size, eps) for _ in range(2)])
        self.self_attn = nn.ModuleList([MLAttention(cfg) for _ in range(2)])
        self.mlps = nn.ModuleList([DenseMLP(cfg.hidden_size, cfg.ffn_hidden_size) for _ in range(2)])


class AttentionHalf(halves.AttentionHalf):
    """Parameter names follow the HF checkpoint (without its `model.` prefix)."""

    cfg: LongcatFlashConfig
    supports_tp = True  # its layers are MLA and dense MLPs

    def __init__(self, cfg: LongcatFlashConfig):
        super().__init__(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([AttentionLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.qk_rope_head_dim, cfg.rope_theta)

    def _layer(self, i: int) -> AttentionLayer:
        return cast(AttentionLayer, self.layers[i])  # nn.ModuleList's items are typed Module

    def pre_moe(self, i: int, x, rope, meta, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i up to the MoE input. kv [2, num_blocks, block_size, C + R]. Returns (h, m)."""
        layer = self._layer(i)
        h = x + layer.self_attn[0](layer.input_layernorm[0](x), *rope, meta, kv[0])
        return h, layer.post_attention_layernorm[0](h)

    def post_moe(self, i: int, h, m, rope, meta, kv: torch.Tensor) -> torch.Tensor:
        """Layer i's work that does not need the MoE output: the window the exchange hides behind."""
        layer = self._layer(i)
        h = h + layer.mlps[0](m)
        h = h + layer.self_attn[1](layer.input_layernorm[1](h), *rope, meta, kv[1])
        return h + layer.mlps[1](layer.post_attention_layernorm[1](h))

    def prefetch_weights(self, i: int, phase: str) -> list[torch.Tensor]:
        """After pre_moe: dense MLP 0's gate and up (post_moe's first GEMMs),
        loading while m is away at the FFN nodes; after post_moe: layer i + 1's latent down-projections."""
        if phase == "pre":
            mlp = cast(DenseMLP, self._layer(i).mlps[0])
            return [mlp.gate_proj.weight, mlp.up_proj.weight]
        if i + 1 == len(self.layers):
            return []
        attn = cast(MLAttention, self._layer(i + 1).self_attn[0])
        q = attn.q_proj if attn.q_proj is not None else attn.q_a_proj
        return [q.weight, attn.kv_a_proj_with_mqa.weight]
