"""DeepSeek-V3's checkpoint name map: hub keys -> the tensors each half holds.

The attention half's parameters carry the hub's names under `model.` (lm_head aside), the shared
experts included (`mlp.shared_experts.*`, on the attention side). The FFN half stacks each MoE layer's
routed experts, so w13[g] = [gate_proj; up_proj]^T and w2[g] = down_proj^T of expert lo + g, read
from the per-expert layout that both DeepSeek's published checkpoints and transformers'
save_pretrained write. MTP modules (model.layers.{L + k}.*) are never asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from afd.model.checkpoint import Weight
from afd.model.deepseek_v3.attention import AttentionHalf
from afd.model.deepseek_v3.ffn import FFNHalf

log = logging.getLogger("afd.model")


def attention_weights(model: AttentionHalf) -> Iterator[Weight]:
    cfg = model.cfg
    if cfg.num_nextn_predict_layers:
        L = cfg.num_hidden_layers
        log.info("skipping the checkpoint's multi-token-prediction layers (model.layers.%d..%d.*, if present): "
                 "afd decodes one token per step", L, L + cfg.num_nextn_predict_layers - 1)
    tied = cfg.tie_word_embeddings
    for name, p in model.named_parameters():
        if name == "lm_head.weight":
            name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        else:
            name = f"model.{name}"
        yield Weight(p, ((name, tuple(p.shape)),))


def _gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=0).t()


def ffn_weights(model: FFNHalf) -> Iterator[Weight]:
    cfg = model.cfg
    lo, hi = model.expert_range
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    for i in cfg.moe_layers:
        pre = f"model.layers.{i}.mlp"
        layer = model.layer(i)
        yield Weight(layer.router.classifier.weight, ((f"{pre}.gate.weight", (E, H)),))
        yield Weight(layer.router.e_score_correction_bias, ((f"{pre}.gate.e_score_correction_bias", (E,)),))
        ex = layer.experts
        for g, e in enumerate(range(lo, hi)):
            x = f"{pre}.experts.{e}"
            yield Weight(ex.w13[g], ((f"{x}.gate_proj.weight", (I, H)), (f"{x}.up_proj.weight", (I, H))), _gate_up)
            yield Weight(ex.w2[g], ((f"{x}.down_proj.weight", (H, I)),), torch.t)
