"""The attention half of DeepSeek-V4: everything but the routed experts, the mHC streams included.

The residual is N = hc_mult streams [T, N, D]; each block collapses them into its input and expands its output
back (afd.model.deepseek_v4.layers.HyperConnection). Layer i is cut where its MoE input leaves:

    post, comb, a = attn_hc(x);  x = post * attn(attn_norm(a)) + comb^T x      # pre_moe
    post, comb, f = ffn_hc(x);   m = ffn_norm(f)                              # pre_moe: m [T, D] crosses
    s = shared_experts(m)                                                     # post_moe: the overlap window
    x = post * (y + s) + comb^T x                                             # combine, y = routed(m)

So what crosses to the FFN half is the collapsed [T, D], while the mixing stays here. The expand needs `post`
and the mixed streams, which ride in h: pre_moe returns h [T, N + 1, D] (the mixed streams, then post in the
first N columns of row N) and post_moe appends the shared expert's output as row N + 1; `combine` takes the
routed output y and makes the next layer's streams. Every V4 layer is an MoE layer.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from afd.model import halves
from afd.model.attention_metadata import AttentionMetadata
from afd.model.deepseek_v4.attention_layer import Attention
from afd.model.deepseek_v4.config import DeepseekV4Config
from afd.model.deepseek_v4.layers import ClippedMLP, HyperConnection, HyperHead, RMSNorm, expand, rotaries


class SharedExpert(nn.Module):
    """The attention side's part of a layer's MoE, named as in the checkpoint (`ffn.shared_experts`)."""

    def __init__(self, cfg: DeepseekV4Config):
        super().__init__()
        self.shared_experts = ClippedMLP(cfg)


class Layer(nn.Module):
    """Checkpoint names: attn, attn_norm, ffn_norm, ffn.shared_experts, hc_{attn,ffn}_{fn,base,scale}."""

    def __init__(self, cfg: DeepseekV4Config, i: int):
        super().__init__()
        self.attn = Attention(cfg, i)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = SharedExpert(cfg)
        self.hc_attn = HyperConnection(cfg)
        self.hc_ffn = HyperConnection(cfg)


class AttentionHalf(halves.AttentionHalf):
    """Parameter names follow the checkpoint as transformers saves it (without its `model.` prefix), but for
    the mHC parameters, which afd.model.deepseek_v4.weights names."""

    cfg: DeepseekV4Config
    supports_graph = False  # the compressed attention walks each sequence's positions on the host
    # the compressors and weights_proj ship in BF16 in the FP8 release (transformers' _keep_in_fp32_modules for
    # V4); wo_a is read as a grouped weight (one bmm over o_groups), never called as a linear
    unquantized = ("compressor.", "indexer.weights_proj", "wo_a")
    # HF's _keep_in_fp32_modules_strict, under afd's names
    keep_in_fp32_strict = (
        "hc_attn.fn",
        "hc_attn.base",
        "hc_attn.scale",
        "hc_ffn.fn",
        "hc_ffn.base",
        "hc_ffn.scale",
        "hc_head.hc_fn",
        "hc_head.hc_base",
        "hc_head.hc_scale",
        "attn_sink",
        "ape",
        "norm.weight",
    )

    def __init__(self, cfg: DeepseekV4Config):
        super().__init__(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Layer(cfg, i) for i in range(cfg.num_layers)])
        self.hc_head = HyperHead(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.main_rope, self.compress_rope = rotaries(cfg)

    def _layer(self, i: int) -> Layer:
        return cast(Layer, self.layers[i])  # nn.ModuleList's items are typed Module

    def embed(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, tuple]:
        """The N streams [T, N, D], each the token's embedding, and (main cos, sin, compress cos, sin)."""
        e = self.embed_tokens(input_ids)
        x = e.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        return x, (
            *self.main_rope.cos_sin(meta.positions, e.dtype),
            *self.compress_rope.cos_sin(meta.positions, e.dtype),
        )

    def pre_moe(self, i: int, x, rope, meta, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, N, D] -> (h [T, N + 1, D], m [T, D]). kv: layer i's state (a PagedLayer of its kinds)."""
        layer = self._layer(i)
        post, comb, a = layer.hc_attn(x)
        x = expand(post, layer.attn(layer.attn_norm(a), rope, meta, kv, self.compress_rope), comb, x)
        post, comb, f = layer.hc_ffn(x)
        mixed = torch.matmul(comb.to(x.dtype).transpose(-1, -2), x)  # [T, N, D]
        row = F.pad(post.to(x.dtype), (0, x.shape[-1] - post.shape[-1])).unsqueeze(1)  # [T, 1, D]
        return torch.cat([mixed, row], dim=1), layer.ffn_norm(f)

    def post_moe(self, i: int, h, m, rope, meta, kv: torch.Tensor) -> torch.Tensor:
        """The shared expert on m (the window the exchange hides behind), appended to h: [T, N + 2, D]."""
        return torch.cat([h, self._layer(i).ffn.shared_experts(m).unsqueeze(1)], dim=1)

    def combine(self, i: int, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The next layer's streams [T, N, D] from h [T, N + 2, D] and the routed experts' y [T, D]."""
        N = self.cfg.hc_mult
        post = h[:, N, :N]
        return post.unsqueeze(-1) * (y + h[:, N + 1]).unsqueeze(-2) + h[:, :N]

    def mtp_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The MTP module fuses the last layer's mHC streams [T, N, D] themselves, before hc_head and norm."""
        return x

    def moe_reads_token_ids(self, i: int) -> bool:
        return self.cfg.mlp_layer_types[i] == "hash_moe"

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.hc_head(x))).float()
