"""LongCat-Flash's MTP block: one dense decoder layer (MLA + SwiGLU MLP), no MoE, so nothing of it
crosses to the FFN nodes:

    h = x + attn(ln_in(x))
    x = h + mlp(ln_post(h))

LongCat-Flash's MTP head is dense (vLLM's longcat_flash_mtp.py builds it with n_routed_experts None,
"LongCat MTP without MoE layers"; SGLang's longcat_flash_nextn.py uses LongcatFlashDenseDecoderLayer),
its MLA is the main model's kind (the same LoRA scales), and its MLP is the dense MLPs' size
(`ffn_hidden_size`, which HF's config also calls intermediate_size). Hub names: afd.model.longcat_flash.weights.
"""

from __future__ import annotations

import torch

from afd.model.halves import MTPBlock as Block
from afd.model.layers import DenseMLP, RMSNorm
from afd.model.longcat_flash.config import LongcatFlashConfig
from afd.model.mla import MLAttention
from afd.model.mtp import MTPLayer


class MTPBlock(Block):
    def __init__(self, cfg: LongcatFlashConfig):
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DenseMLP(cfg.hidden_size, cfg.ffn_hidden_size)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One MLA caching latents: [blocks, block_size, C + R]."""
        return (num_blocks, block_size, self.cfg.latent_dim)

    def pre_moe(self, x, rope, meta, kv: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x + self.self_attn(self.input_layernorm(x), *rope, meta, kv), None

    def post_moe(self, h, m, rope, meta, kv: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.post_attention_layernorm(h))


def check(cfg: LongcatFlashConfig) -> None:
    """Every LongCat-Flash checkpoint carries one MTP layer (model.mtp.*); a missing tensor is named by
    the loader."""


def moe_layers(cfg: LongcatFlashConfig) -> tuple[int, ...]:
    return ()


def build(cfg: LongcatFlashConfig) -> MTPLayer:
    return MTPLayer(cfg, MTPBlock(cfg), None)
