"""LongCat-Flash's checkpoint name map: hub keys -> the tensors each half holds.

The attention half's parameters carry the hub's names under `model.` (lm_head aside); the FFN half
stacks each layer's experts, so w13[g] = [gate_proj; up_proj]^T and w2[g] = down_proj^T of expert held[g].
The MTP module (afd.model.longcat_flash.mtp) lives under model.mtp.*: the names vLLM's
longcat_flash_mtp.py and SGLang's longcat_flash_nextn.py map from the hub checkpoint (enorm and hnorm
under `.m`, the MLP under `transformer_layer.mlp`, the final norm outside `layers.0`).
"""

from __future__ import annotations

from collections.abc import Iterator

from afd.model.checkpoint import Weight, hub_named_weights, per_expert_weights
from afd.model.longcat_flash.attention import AttentionHalf
from afd.model.longcat_flash.ffn import FFNHalf


def attention_weights(model: AttentionHalf) -> Iterator[Weight]:
    return hub_named_weights(model)


MTP = "model.mtp.layers.0"
_MTP_NAMES = {
    "enorm.weight": f"{MTP}.enorm.m.weight",
    "hnorm.weight": f"{MTP}.hnorm.m.weight",
    "eh_proj.weight": f"{MTP}.eh_proj.weight",
    "norm.weight": "model.mtp.norm.weight",
}


def mtp_weights(model) -> Iterator[Weight]:
    """The MTP layer (afd.model.mtp.MTPLayer): its block's parameters keep the hub's names under
    model.mtp.layers.0, but for the MLP's `transformer_layer.` prefix."""
    for name, p in model.named_parameters():
        if name in _MTP_NAMES:
            key = _MTP_NAMES[name]
        else:
            inner = name.removeprefix("block.")
            key = f"{MTP}.transformer_layer.{inner}" if inner.startswith("mlp.") else f"{MTP}.{inner}"
        yield Weight(p, ((key, tuple(p.shape)),))


def ffn_weights(model: FFNHalf) -> Iterator[Weight]:
    cfg = model.cfg
    H, E = cfg.hidden_size, cfg.num_experts_total
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}.mlp"
        layer = model.layer(i)
        router = layer.router
        yield Weight(router.classifier.weight, ((f"{pre}.router.classifier.weight", (E, H)),))
        yield Weight(router.e_score_correction_bias, ((f"{pre}.router.e_score_correction_bias", (E,)),))
        yield from per_expert_weights(layer.experts, f"{pre}.experts", H, cfg.expert_ffn_hidden_size)
