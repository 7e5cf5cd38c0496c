"""The attention half of Qwen3-MoE: everything but the sparse MoE blocks.

Each layer is cut where its MoE input leaves and its MoE output returns:

    h = x + attn(ln_in(x));  m = ln_post(h)       # pre_moe: m crosses to the FFN half
    x = h + y                                     # y = MoE(m), back from the FFN half

Nothing of the layer is left to hide the exchange behind (post_moe returns h): the overlap comes from
the runner's micro-batch ping-pong. A dense layer (`mlp_only_layers`, `decoder_sparse_step`) sends
nothing: pre_moe returns m = None and post_moe adds the layer's MLP, x = h + mlp(ln_post(h)).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from afd.model import halves
from afd.model.gqa import GQAttention
from afd.model.layers import DenseMLP, RMSNorm, Rotary
from afd.model.qwen3_moe.config import Qwen3MoeConfig


class AttentionLayer(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, dense: bool):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = GQAttention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.attention_bias,
            qk_norm_eps=eps,
        )
        self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size) if dense else None


class AttentionHalf(halves.AttentionHalf):
    """Parameter names follow the HF checkpoint (without its `model.` prefix). No TP layers yet (GQA)."""

    cfg: Qwen3MoeConfig

    def __init__(self, cfg: Qwen3MoeConfig):
        super().__init__(cfg)
        moe = set(cfg.moe_layers)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([AttentionLayer(cfg, i not in moe) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    def _layer(self, i: int) -> AttentionLayer:
        return cast(AttentionLayer, self.layers[i])  # nn.ModuleList's items are typed Module

    def pre_moe(self, i: int, x, rope, meta, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer i up to the MoE input. kv [2, num_blocks, block_size, KVH, D]. Returns (h, m), m None if dense."""
        layer = self._layer(i)
        h = x + layer.self_attn(layer.input_layernorm(x), *rope, meta, kv)
        if layer.mlp is not None:
            return h, None
        return h, layer.post_attention_layernorm(h)

    def post_moe(self, i: int, h, m, rope, meta, kv: torch.Tensor) -> torch.Tensor:
        """A sparse layer has no work left before its MoE output; a dense one runs its MLP here."""
        layer = self._layer(i)
        if layer.mlp is None:
            return h
        return h + layer.mlp(layer.post_attention_layernorm(h))
