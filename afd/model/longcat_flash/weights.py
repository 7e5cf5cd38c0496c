"""LongCat-Flash's checkpoint name map: hub keys -> the tensors each half holds.

The attention half's parameters carry the hub's names under `model.` (lm_head aside); the FFN half
stacks each layer's experts, so w13[g] = [gate_proj; up_proj]^T and w2[g] = down_proj^T of expert lo + g.
"""

from __future__ import annotations

from collections.abc import Iterator

from afd.model.checkpoint import Weight, hub_named_weights, per_expert_weights
from afd.model.longcat_flash.attention import AttentionHalf
from afd.model.longcat_flash.ffn import FFNHalf


def attention_weights(model: AttentionHalf) -> Iterator[Weight]:
    return hub_named_weights(model)


def ffn_weights(model: FFNHalf) -> Iterator[Weight]:
    cfg = model.cfg
    H, E = cfg.hidden_size, cfg.num_experts_total
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}.mlp"
        router = layer.router
        yield Weight(router.classifier.weight, ((f"{pre}.router.classifier.weight", (E, H)),))
        yield Weight(router.e_score_correction_bias, ((f"{pre}.router.e_score_correction_bias", (E,)),))
        yield from per_expert_weights(layer.experts, f"{pre}.experts", H, cfg.expert_ffn_hidden_size)


def extra_checkpoint_keys(cfg) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Keys a hub-layout checkpoint holds that afd never reads: transformers' LongcatFlashExperts
    allocates gate/up rows for the identity experts too and refuses a checkpoint without them."""
    H, I = cfg.hidden_size, cfg.expert_ffn_hidden_size
    for i in range(cfg.num_layers):
        for e in range(cfg.n_routed_experts, cfg.num_experts_total):
            for name in ("gate_proj", "up_proj"):
                yield f"model.layers.{i}.mlp.experts.{e}.{name}.weight", (I, H)
