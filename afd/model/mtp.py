"""The multi-token-prediction (MTP) module a checkpoint carries beside its decoder, as a draft model.

DeepSeek-V3's technical report (section 2.2) and LongCat-Flash share the shape: at position t the module
sees the main model's hidden state h_t and the embedding of the token at t + 1, and predicts the token at
t + 2 through one transformer block and the main model's head:

    x      = eh_proj([enorm(embed(tok_{t+1})); hnorm(h_t)])     # [T, 2H] -> [T, H]
    x      = block(x)                                            # attention on its own KV cache layer, MLP/MoE
    h'_t   = norm(x)                                             # [T, H]
    logits = lm_head(h'_t)                                       # the main model's head (shared)

h_t is the hidden state the main model's head reads (after its final norm), as vLLM, SGLang and
transformers' MtpModel hand it over. Drafting a second token reuses the module one position further on,
with h'_t in place of the main model's h_{t+1} (which does not exist yet): transformers' MtpModel chains
its layers the same way. The embedding and the head are the main model's own (the report: "shared"), so
the checkpoint's copies of them (DeepSeek-V3's model.layers.61.embed_tokens / shared_head.head,
LongCat-Flash's model.mtp.embed_tokens) are not read, as SGLang's loaders skip them.

A family provides its block in `afd.model.<family>.mtp` (`build(cfg) -> MTPLayer`, `moe_layers(cfg)`)
and the checkpoint name map in its weights.py (`mtp_weights`); its registry record names the module
(`Family.mtp`). The block (an afd.model.halves.MTPBlock) has the decoder layer's split:
`pre_moe(x, rope, meta, kv) -> (h, m)` with m the MoE input (None for a dense block) and
`post_moe(h, m, rope, meta, kv) -> h`; the MoE output is added by the caller through the same exchange as
the main model's layers (afd.engine.runner, FLAG_MTP steps on the data plane).
"""

from __future__ import annotations

import torch
from torch import nn

from afd.model.config import ConfigError, ModelConfig
from afd.model.halves import LoadedModule, MTPBlock
from afd.model.layers import RMSNorm
from afd.model.registry import family

MAX_SPECULATIVE_TOKENS = 2
"""--speculative-tokens N: 1 or 2 (MTP1 and MTP2 of docs/design/longcat-on-ascend.md#mtp)."""


class MTPLayer(LoadedModule):
    """enorm, hnorm and eh_proj around a family's block, and the norm before the shared head."""

    def __init__(self, cfg: ModelConfig, block: MTPBlock, moe_layer: int | None):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(H, eps)
        self.hnorm = RMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.block = block
        self.norm = RMSNorm(H, eps)
        self.moe_layer = moe_layer
        """The layer id its MoE input goes to the exchange under (the FFN half's `mtp_layers`), or None
        when the block is dense and nothing crosses."""

    def fuse(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """e [T, H] embeddings of the next tokens, h [T, H] hidden states -> the block's input [T, H]."""
        return self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))

    def combine(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The block's output from its h and its routed experts' y: the residual sum by default (DeepSeek-V4's
        expands y into its mHC streams)."""
        return h + y

    def draft(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output h at the sequences' last positions -> (what the next draft step fuses, what the
        main model's lm_head reads): the final norm's output for both by default."""
        out = self.norm(h)
        return out, out

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The block's own KV cache layer (addressed by the main model's block tables)."""
        return self.block.kv_cache_shape(num_blocks, block_size)


def family_mtp(cfg: ModelConfig):
    """cfg's family's MTP module (afd.model.<family>.mtp), or ConfigError when the family has none."""
    fam = family(cfg.model_type).mtp_module
    if fam is None:
        raise ConfigError(
            f"--speculative-tokens: {cfg.model_type} has no multi-token-prediction module "
            "(MTP drafts come from the checkpoint's MTP layer: longcat_flash, deepseek_v3)"
        )
    fam.check(cfg)
    return fam


def check_speculative_tokens(n: int) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"speculative_tokens must be 0 (off), 1 or 2, got {n!r}")


def mtp_moe_layers(cfg: ModelConfig) -> tuple[int, ...]:
    """The MoE layer ids the FFN side must hold for the MTP module (empty for a dense MTP block)."""
    return family_mtp(cfg).moe_layers(cfg)
