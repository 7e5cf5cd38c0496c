"""DeepSeek-V3's MTP block: decoder layer num_hidden_layers of the checkpoint (model.layers.61 in the
published one), an MoE layer like the decoder's from first_k_dense_replace on:

    h = x + attn(ln_in(x));  m = ln_post(h)        # pre_moe: m crosses to the FFN nodes (layer L)
    h = h + shared_experts(m)                      # post_moe, while the routed experts are out
    x = h + y                                      # y = routed experts(m), from the FFN nodes

vLLM's deepseek_mtp.py builds the same block (DeepseekV2DecoderLayer with prefix model.layers.{L}), and
transformers' MtpModel renames model.layers.{L}.* to its mtp_block. Its routed experts live on the FFN
nodes as MoE layer L (afd.model.deepseek_v3.ffn, `mtp_layers`).
"""

from __future__ import annotations

import torch

from afd.model.config import ConfigError
from afd.model.deepseek_v3.attention import AttentionLayer
from afd.model.deepseek_v3.config import DeepseekV3Config
from afd.model.halves import MTPBlock as Block
from afd.model.mtp import MTPLayer


class MTPBlock(AttentionLayer, Block):
    def __init__(self, cfg: DeepseekV3Config):
        super().__init__(cfg, cfg.num_hidden_layers)
        self.cfg = cfg

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One MLA caching latents: [blocks, block_size, C + R]."""
        return (num_blocks, block_size, self.cfg.latent_dim)

    def pre_moe(self, x, rope, meta, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = x + self.self_attn(self.input_layernorm(x), *rope, meta, kv)
        return h, (self.post_attention_layernorm(h) if self.is_moe else None)

    def post_moe(self, h, m, rope, meta, kv: torch.Tensor) -> torch.Tensor:
        if m is None:  # a dense MTP layer (every decoder layer dense): its whole MLP is here
            m = self.post_attention_layernorm(h)
        return h + self.mlp(m)


def check(cfg: DeepseekV3Config) -> None:
    if cfg.num_nextn_predict_layers < 1:
        raise ConfigError(
            "--speculative-tokens: config.json says num_nextn_predict_layers "
            f"{cfg.num_nextn_predict_layers}: the checkpoint has no MTP module"
        )


def moe_layers(cfg: DeepseekV3Config) -> tuple[int, ...]:
    return cfg.mtp_moe_layers


def build(cfg: DeepseekV3Config) -> MTPLayer:
    block = MTPBlock(cfg)
    return MTPLayer(cfg, block, cfg.num_hidden_layers if block.is_moe else None)
