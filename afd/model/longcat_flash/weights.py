"""LongCat-Flash's checkpoint name map: hub keys -> the tensors each half holds.

The attention half's parameters carry the hub's names under `model.` (lm_head aside); the FFN half
stacks each layer's experts, so w13[g] = [gate_proj; up_proj]^T and w2[g] = down_proj^T of expert lo + g.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from afd.model.checkpoint import Weight
from afd.model.longcat_flash.attention import AttentionHalf
from afd.model.longcat_flash.ffn import FFNHalf


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
    H, I, E = cfg.hidden_size, cfg.expert_ffn_hidden_size, cfg.num_experts_total
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}.mlp"
        router = layer.router
        yield Weight(router.classifier.weight, ((f"{pre}.router.classifier.weight", (E, H)),))
        yield Weight(router.e_score_correction_bias, ((f"{pre}.router.e_score_correction_bias", (E,)),))
        ex = layer.experts
        for g, e in enumerate(range(lo, hi)):
            x = f"{pre}.experts.{e}"
            yield Weight(ex.w13[g], ((f"{x}.gate_proj.weight", (I, H)), (f"{x}.up_proj.weight", (I, H))), _gate_up)
            yield Weight(ex.w2[g], ((f"{x}.down_proj.weight", (H, I)),), torch.t)


def extra_checkpoint_keys(cfg) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Keys a hub-layout checkpoint holds that afd never reads: transformers' LongcatFlashExperts
    allocates gate/up rows for the identity experts too and refuses a checkpoint without them."""
    H, I = cfg.hidden_size, cfg.expert_ffn_hidden_size
    for i in range(cfg.num_layers):
        for e in range(cfg.n_routed_experts, cfg.num_experts_total):
            for name in ("gate_proj", "up_proj"):
                yield f"model.layers.{i}.mlp.experts.{e}.{name}.weight", (I, H)
