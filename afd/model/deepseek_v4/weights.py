"""DeepSeek-V4's checkpoint name map: checkpoint keys -> the tensors each half holds.

The keys are those transformers' save_pretrained writes for DeepseekV4ForCausalLM (its conversion mapping
turns its module names back into DeepSeek's: models/deepseek_v4 in transformers' conversion_mapping.py):
`model.layers.{i}.attn.{wq_a,q_norm,wq_b,wkv,norm,wo_a,wo_b,attn_sink}`, the compressor and indexer under
`attn.compressor.*` / `attn.indexer.*`, `attn_norm` / `ffn_norm`, the mHC as `hc_attn_{fn,base,scale}` and
`hc_ffn_*`, `model.hc_head.hc_{fn,base,scale}`, the head as `head.weight`. The MoE: `ffn.gate.weight`, with
`ffn.gate.bias` (the correction bias) on learned layers and `ffn.gate.tid2eid` on hash layers, the shared
expert `ffn.shared_experts.w{1,2,3}` (attention side) and the routed ones `ffn.experts.{e}.w{1,2,3}` (w1 gate,
w3 up, w2 down). The MTP layers (`mtp.*`) are not read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from afd.model.checkpoint import CheckpointError, Weight
from afd.model.deepseek_v4.attention import AttentionHalf
from afd.model.deepseek_v4.ffn import FFNHalf

_HC = re.compile(r"^layers\.(\d+)\.hc_(attn|ffn)\.(fn|base|scale)$")


def attention_weights(model: AttentionHalf) -> Iterator[Weight]:
    tied = model.cfg.tie_word_embeddings
    for name, p in model.named_parameters():
        if name == "lm_head.weight":
            key = "model.embed_tokens.weight" if tied else "head.weight"
        elif hc := _HC.match(name):
            key = f"model.layers.{hc[1]}.hc_{hc[2]}_{hc[3]}"
        else:
            key = f"model.{name}"
        yield Weight(p, ((key, tuple(p.shape)),))


def _expert_ids(n_routed: int):
    """tid2eid as stored (int64 ids, checked in range), or, from afd's dummy reader (seeded floats: afd bench's
    V4-shaped models), valid ids made from them."""

    def combine(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return (t.abs() * 1e4).long() % n_routed
        if t.numel() and not 0 <= int(t.min()) <= int(t.max()) < n_routed:
            raise CheckpointError(f"tid2eid holds expert ids outside [0, {n_routed})")
        return t

    return combine


def _gate_up(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    return torch.cat([w1, w3], dim=0).t()


def ffn_weights(model: FFNHalf) -> Iterator[Weight]:
    cfg = model.cfg
    H, E, I, K = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    for i in cfg.moe_layers:
        pre = f"model.layers.{i}.ffn"
        layer = model.layer(i)
        yield Weight(layer.router.classifier.weight, ((f"{pre}.gate.weight", (E, H)),))
        if layer.router.hashed:
            tid2eid = ((f"{pre}.gate.tid2eid", (cfg.vocab_size, K)),)
            yield Weight(layer.router.tid2eid, tid2eid, _expert_ids(E))
        else:
            yield Weight(layer.router.e_score_correction_bias, ((f"{pre}.gate.bias", (E,)),))
        experts = layer.experts
        if experts.quant is not None:
            raise NotImplementedError("DeepSeek-V4's quantized experts are not loaded yet (issue 31)")
        for g, e in enumerate(experts.held):
            x = f"{pre}.experts.{e}"
            yield Weight(experts.w13[g], ((f"{x}.w1.weight", (I, H)), (f"{x}.w3.weight", (I, H))), _gate_up)
            yield Weight(experts.w2[g], ((f"{x}.w2.weight", (H, I)),), torch.t)
