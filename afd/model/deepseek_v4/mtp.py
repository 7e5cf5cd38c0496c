"""DeepSeek-V4's MTP module (`mtp.{k}.*` in the released checkpoint; transformers 5.24 drops those keys,
_keys_to_ignore_on_load_unexpected, so HF is no oracle for it).

Its structure is DeepSeek's inference code's `MTPBlock(Block)` (deepseek-ai's DeepSeek-V4 inference/model.py,
as third-party ports quote it, e.g. reference/model.py:738-766 in the V4-Flash release, and the tensor listing
of the released checkpoint: `mtp.0.{e_proj,h_proj,enorm,hnorm,norm}`, `mtp.0.hc_head_{fn,base,scale}`,
`mtp.0.hc_{attn,ffn}_*`, `mtp.0.attn.*` without compressor or indexer, `mtp.0.ffn.gate.{weight,bias}`,
`mtp.0.ffn.{experts,shared_experts}.*`). Unlike V3's, it works on the mHC streams, not one hidden state:

    x      = e_proj(enorm(embed(tok_{t+1}))) [T, 1, D] + h_proj(hnorm(x_t)) [T, N, D]   # x_t: the main
                                                  # model's last streams, before its hc_head and norm
    x      = block(x)                             # a full V4 layer: mHC, sliding-window attention, MoE
    logits = head(norm(hc_head(x)))               # its own hc_head and norm, the main model's head

The block is decoder layer num_hidden_layers with a sliding-window attention (no compressor, no indexer) and
a learned ("moe") router with its correction bias; its routed experts are MoE layer num_hidden_layers.

How afd's runner drives it differently from V3's (afd.engine.runner.mtp_step, through the hooks): it gets the
main model's streams un-normed (AttentionHalf.mtp_hidden), adds the routed output through the block's
`combine` (post * (y + shared) + mixed streams, not h + y), and drafts from `head(h)` (hc_head before the
norm); a second draft chains the block's output streams, not a normed hidden state (MTPLayer.draft).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from afd.model import halves
from afd.model.config import ConfigError
from afd.model.deepseek_v4.attention import Layer
from afd.model.deepseek_v4.config import SWA, DeepseekV4Config
from afd.model.deepseek_v4.layers import HyperHead, RMSNorm, expand
from afd.model.deepseek_v4.state import layer_planes


def mtp_config(cfg: DeepseekV4Config) -> DeepseekV4Config:
    """cfg with the MTP block as one more layer: sliding-window attention, a learned router."""
    return dataclasses.replace(
        cfg,
        num_hidden_layers=cfg.num_hidden_layers + 1,
        layer_types=(*cfg.layer_types, SWA),
        mlp_layer_types=(*cfg.mlp_layer_types, "moe"),
    )


class MTPBlock(Layer, halves.MTPBlock):
    """Decoder layer num_hidden_layers, split as AttentionHalf's layers are (afd.model.deepseek_v4.attention):
    pre_moe -> (h [T, N + 1, D], m [T, D]), post_moe appends the shared expert, combine adds the routed y."""

    def __init__(self, cfg: DeepseekV4Config):
        ext = mtp_config(cfg)
        super().__init__(ext, cfg.num_hidden_layers)
        self.cfg, self.index = ext, cfg.num_hidden_layers

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Its sliding-window token plane: [blocks, E] (afd.model.deepseek_v4.state)."""
        return (num_blocks, layer_planes(self.cfg, self.index).block_values(block_size))

    def pre_moe(self, x, rope, meta, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        post, comb, a = self.hc_attn(x)
        x = expand(post, self.attn(self.attn_norm(a), rope, meta, kv, None), comb, x)
        post, comb, f = self.hc_ffn(x)
        mixed = torch.matmul(comb.to(x.dtype).transpose(-1, -2), x)  # [T, N, D]
        row = F.pad(post.to(x.dtype), (0, x.shape[-1] - post.shape[-1])).unsqueeze(1)  # [T, 1, D]
        return torch.cat([mixed, row], dim=1), self.ffn_norm(f)

    def post_moe(self, h, m, rope, meta, kv: torch.Tensor) -> torch.Tensor:
        return torch.cat([h, self.ffn.shared_experts(m).unsqueeze(1)], dim=1)

    def combine(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The block's output streams [T, N, D] from h [T, N + 2, D] and the routed experts' y [T, D]."""
        N = self.cfg.hc_mult
        return h[:, N, :N].unsqueeze(-1) * (y + h[:, N + 1]).unsqueeze(-2) + h[:, :N]


class MTPLayer(halves.LoadedModule):
    """e_proj, h_proj and their norms before the block; its own hc_head and norm after it. Checkpoint names
    under `mtp.{k}.` (afd.model.deepseek_v4.weights.mtp_weights)."""

    keep_in_fp32_strict = (
        *("hc_attn.fn", "hc_attn.base", "hc_attn.scale", "hc_ffn.fn", "hc_ffn.base", "hc_ffn.scale"),
        *("hc_head.hc_fn", "hc_head.hc_base", "hc_head.hc_scale", "attn_sink", "norm.weight"),
    )

    def __init__(self, cfg: DeepseekV4Config):
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg = cfg
        self.enorm = RMSNorm(D, eps)
        self.hnorm = RMSNorm(D, eps)
        self.e_proj = nn.Linear(D, D, bias=False)
        self.h_proj = nn.Linear(D, D, bias=False)
        self.block = MTPBlock(cfg)
        self.hc_head = HyperHead(cfg)
        self.norm = RMSNorm(D, eps)
        self.moe_layer = cfg.num_hidden_layers
        """The MoE layer id its routed experts serve under (the FFN half's `mtp_layers`)."""

    def fuse(self, e: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """e [T, D] (or the main model's embedded streams [T, N, D], all equal) and the main model's last
        streams [T, N, D] -> the block's input streams [T, N, D]."""
        if e.dim() == 3:
            e = e[:, 0]
        return self.e_proj(self.enorm(e)).unsqueeze(1) + self.h_proj(self.hnorm(streams))

    def head(self, streams: torch.Tensor) -> torch.Tensor:
        """The block's output streams [T, N, D] -> the hidden state the main model's lm_head reads [T, D]."""
        return self.norm(self.hc_head(streams))

    def combine(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The block's routed output y expanded into its streams, as the main model's layers do."""
        return self.block.combine(h, y)

    def draft(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The next draft step chains the streams themselves; the lm_head reads them collapsed and normed."""
        return h, self.head(h)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return self.block.kv_cache_shape(num_blocks, block_size)


def check(cfg: DeepseekV4Config) -> None:
    if cfg.num_nextn_predict_layers < 1:
        raise ConfigError(
            "--speculative-tokens: config.json says num_nextn_predict_layers "
            f"{cfg.num_nextn_predict_layers}: the checkpoint has no MTP module"
        )


def moe_layers(cfg: DeepseekV4Config) -> tuple[int, ...]:
    return (cfg.num_hidden_layers,) if cfg.num_nextn_predict_layers else ()


def build(cfg: DeepseekV4Config) -> MTPLayer:
    return MTPLayer(cfg)
