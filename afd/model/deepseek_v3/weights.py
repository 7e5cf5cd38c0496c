"""DeepSeek-V3's checkpoint name map: hub keys -> the tensors each half holds.

The attention half's parameters carry the hub's names under `model.` (lm_head aside), the shared
experts included (`mlp.shared_experts.*`, on the attention side). The FFN half stacks each MoE layer's
routed experts, so w13[g] = [gate_proj; up_proj]^T and w2[g] = down_proj^T of expert held[g], read
from the per-expert layout that both DeepSeek's published checkpoints and transformers'
save_pretrained write. The MTP module (afd.model.deepseek_v3.mtp) is decoder layer L = num_hidden_layers
of the checkpoint, as vLLM's deepseek_mtp.py reads it: model.layers.{L}.{enorm,hnorm,eh_proj}.weight,
model.layers.{L}.shared_head.norm.weight (the norm before the head), and a decoder layer's keys for its
block, routed experts included (the FFN half's layer L). Its embed_tokens and shared_head.head copies
are not read: the main model's serve (SGLang's nextn loader skips them the same way). Without
speculative decoding nothing under model.layers.{L}.* is asked for.
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
        log.info(
            "the decoder does not read the checkpoint's multi-token-prediction layers (model.layers.%d..%d.*, "
            "if present); --speculative-tokens loads the first as the draft model",
            L,
            L + cfg.num_nextn_predict_layers - 1,
        )
    yield from hub_named_weights(model)


def mtp_weights(model) -> Iterator[Weight]:
    """The MTP layer (afd.model.mtp.MTPLayer) from model.layers.{num_hidden_layers}.*."""
    pre = f"model.layers.{model.block.cfg.num_hidden_layers}"
    for name, p in model.named_parameters():
        key = "shared_head.norm.weight" if name == "norm.weight" else name.removeprefix("block.")
        yield Weight(p, ((f"{pre}.{key}", tuple(p.shape)),))


def ffn_weights(model: FFNHalf) -> Iterator[Weight]:
    cfg = model.cfg
    H, E = cfg.hidden_size, cfg.n_routed_experts
    for i in (*cfg.moe_layers, *model.mtp_layers):  # the MTP module's MoE is layer num_hidden_layers
        pre = f"model.layers.{i}.mlp"
        layer = model.layer(i)
        yield Weight(layer.router.classifier.weight, ((f"{pre}.gate.weight", (E, H)),))
        yield Weight(layer.router.e_score_correction_bias, ((f"{pre}.gate.e_score_correction_bias", (E,)),))
        yield from per_expert_weights(layer.experts, f"{pre}.experts", H, cfg.moe_intermediate_size)
