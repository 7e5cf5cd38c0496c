"""Qwen3-MoE's checkpoint name map: hub keys -> the tensors each half holds.

The attention half's parameters carry the hub's names under `model.` (lm_head aside; a dense layer's
`mlp` is the hub's too). The FFN half stacks each sparse layer's experts, w13[g] = [gate_proj; up_proj]^T
and w2[g] = down_proj^T of expert held[g], from the per-expert keys save_pretrained and the hub write.
"""

from __future__ import annotations

from collections.abc import Iterator

from afd.model.checkpoint import Weight, hub_named_weights, per_expert_weights
from afd.model.qwen3_moe.attention import AttentionHalf
from afd.model.qwen3_moe.ffn import FFNHalf


def attention_weights(model: AttentionHalf) -> Iterator[Weight]:
    return hub_named_weights(model)


def ffn_weights(model: FFNHalf) -> Iterator[Weight]:
    cfg = model.cfg
    H, E = cfg.hidden_size, cfg.num_experts
    for i in cfg.moe_layers:
        pre = f"model.layers.{i}.mlp"
        layer = model.layer(i)
        yield Weight(layer.router.classifier.weight, ((f"{pre}.gate.weight", (E, H)),))
        yield from per_expert_weights(layer.experts, f"{pre}.experts", H, cfg.moe_intermediate_size)
