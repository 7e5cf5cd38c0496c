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

from afd.model.checkpoint import Weight, hub_named_weights, per_expert_weights
from afd.model.deepseek_v3.attention import AttentionHalf
from afd.model.deepseek_v3.ffn import FFNHalf

log = logging.getLogger("afd.model")


def attention_weights(model: AttentionHalf) -> Iterator[Weight]:
    cfg = model.cfg
    if cfg.num_nextn_predict_layers:
        L = cfg.num_hidden_layers
        log.info("skipping the checkpoint's multi-token-prediction layers (model.layers.%d..%d.*, if present): "
                 "afd decodes one token per step", L, L + cfg.num_nextn_predict_layers - 1)
    yield from hub_named_weights(model)


def ffn_weights(model: FFNHalf) -> Iterator[Weight]:
    cfg = model.cfg
    H, E = cfg.hidden_size, cfg.n_routed_experts
    for i in cfg.moe_layers:
        pre = f"model.layers.{i}.mlp"
        layer = model.layer(i)
        yield Weight(layer.router.classifier.weight, ((f"{pre}.gate.weight", (E, H)),))
        yield Weight(layer.router.e_score_correction_bias, ((f"{pre}.gate.e_score_correction_bias", (E,)),))
        yield from per_expert_weights(layer.experts, f"{pre}.experts", H, cfg.moe_intermediate_size)
