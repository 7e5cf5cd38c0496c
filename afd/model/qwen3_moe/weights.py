"""Qwen3-MoE's checkpoint name map: hub keys -> the tensors each half holds.

The attention half's parameters carry the hub's names under `model.` (lm_head aside; a dense layer's
`mlp` is the hub's too). The FFN half stacks each sparse layer's experts, w13[g] = [gate_proj; up_proj]^T
and w2[g] = down_proj^T of expert lo + g, from the per-expert keys save_pretrained and the hub write.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from afd.model.checkpoint import Weight
from afd.model.qwen3_moe.attention import AttentionHalf
from afd.model.qwen3_moe.ffn import FFNHalf


def attention_weights(model: AttentionHalf) -> Iterator[Weight]:
    tied = model.cfg.tie_word_embeddings
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
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    for i in cfg.moe_layers:
        pre = f"model.layers.{i}.mlp"
        layer = model.layer(i)
        yield Weight(layer.router.classifier.weight, ((f"{pre}.gate.weight", (E, H)),))
        ex = layer.experts
        for g, e in enumerate(range(lo, hi)):
            x = f"{pre}.experts.{e}"
            yield Weight(ex.w13[g], ((f"{x}.gate_proj.weight", (I, H)), (f"{x}.up_proj.weight", (I, H))), _gate_up)
            yield Weight(ex.w2[g], ((f"{x}.down_proj.weight", (H, I)),), torch.t)
