r"""DeepSeek-V4's checkpoint name map: checkpoint keys -> the tensors each half holds.

The keys are those transformers' save_pretrained writes for DeepseekV4ForCausalLM (its conversion mapping
turns its module names back into DeepSeek's: models/deepseek_v4 in transformers' conversion_mapping.py):
`model.layers.{i}.attn.{wq_a,q_norm,wq_b,wkv,norm,wo_a,wo_b,attn_sink}`, the compressor and indexer under
`attn.compressor.*` / `attn.indexer.*`, `attn_norm` / `ffn_norm`, the mHC as `hc_attn_{fn,base,scale}` and
`hc_ffn_*`, `model.hc_head.hc_{fn,base,scale}`, the head as `head.weight`. The MoE: `ffn.gate.weight`, with
`ffn.gate.bias` (the correction bias) on learned layers and `ffn.gate.tid2eid` on hash layers, the shared
expert `ffn.shared_experts.w{1,2,3}` (attention side) and the routed ones `ffn.experts.{e}.w{1,2,3}` (w1 gate,
w3 up, w2 down). The MTP layers (`mtp.*`) are read by mtp_weights.

Two layouts are read: transformers' (above) and DeepSeek's released one, which ReleasedReader maps onto it.
The released checkpoint names its tensors as DeepSeek's inference code does, without HF's `model.` prefix:
`embed.weight`, `layers.{i}.*` (the same leaf names as transformers writes), `norm.weight`, `head.weight`,
`hc_head_{fn,base,scale}`, `mtp.{k}.*`; its FP8 tensors (float8_e4m3fn) carry their block scales as
`<module>.scale`, not `<module>.weight_scale_inv`, stored ue8m0 (float8_e8m0fnu, a power of two) when
quantization_config says `scale_fmt: ue8m0`. Sources: transformers 5.24's conversion_mapping.py
("deepseek_v4": `^embed\.weight` -> embed_tokens, `^hc_head_fn` -> hc_head.hc_fn, ...) and
quantizers/quantizer_finegrained_fp8.py (`^(.+)\.scale` -> weight_scale_inv, "e.g. DeepSeek-V4-Flash"),
FineGrainedFP8Config's scale_fmt (utils/quantization_config.py). FP4 routed experts (expert_dtype "fp4",
DeepSeek-V4-Flash) are refused by the config (afd.model.deepseek_v4.config).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from afd.model.checkpoint import CheckpointError, Reader, SafetensorsReader, Weight
from afd.model.deepseek_v4.attention import AttentionHalf
from afd.model.deepseek_v4.ffn import FFNHalf
from afd.quant.formats import FP8

_HC = re.compile(r"^layers\.(\d+)\.hc_(attn|ffn)\.(fn|base|scale)$")
_RELEASED = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}
_RELEASED.update({f"model.hc_head.hc_{p}": f"hc_head_{p}" for p in ("fn", "base", "scale")})


def released_key(key: str) -> str:
    """A key as transformers saves it -> the released checkpoint's name for the same tensor; a weight's
    block scales (`X.weight_scale_inv`) -> `X.scale`."""
    if key.endswith(".weight_scale_inv"):
        return released_key(key.removesuffix("_scale_inv")).removesuffix("weight") + "scale"
    if key in _RELEASED:
        return _RELEASED[key]
    return key.removeprefix("model.")


class ReleasedReader(SafetensorsReader):
    """A checkpoint in DeepSeek's released layout, read under transformers' names (the name map's):
    every key goes through released_key, and block scales stored ue8m0 widen to fp32 exactly."""

    def _tensor(self, key: str, shape: tuple[int, ...] | None) -> torch.Tensor:
        return super()._tensor(released_key(key), shape)

    def __contains__(self, key: str) -> bool:
        return released_key(key) in self._where

    def get_fp8(self, key: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        t = self._tensor(key, shape)
        if t.dtype != FP8:
            return None
        name, skey = released_key(key), released_key(key.removesuffix("weight") + "weight_scale_inv")
        if self.fp8 is None:
            raise CheckpointError(
                f"{self.path}: tensor '{name}' is float8_e4m3fn but config.json has no quantization_config"
            )
        if skey not in self._where:
            raise CheckpointError(f"{self.path}: FP8 tensor '{name}' has no '{skey}' (its block scales)")
        (bn, bk), (N, K) = self.fp8.block, shape
        blocks = (-(-N // bn), -(-K // bk))
        scale = self._tensor(key.removesuffix("weight") + "weight_scale_inv", None)
        if tuple(scale.shape) != blocks or scale.dtype not in (torch.float32, torch.float8_e8m0fnu):
            raise CheckpointError(
                f"{self.path}: '{skey}' is {scale.dtype} {tuple(scale.shape)}; weight_block_size {[bn, bk]} on "
                f"{tuple(shape)} implies fp32 or ue8m0 scales of shape {blocks}"
            )
        return t, scale.float()


def checkpoint_reader(reader: Reader) -> Reader:
    """`reader` itself for transformers' layout (or afd's dummy weights), a ReleasedReader over the same
    files for DeepSeek's released layout (told by its `embed.weight`)."""
    if (
        not isinstance(reader, SafetensorsReader)
        or "model.embed_tokens.weight" in reader
        or "embed.weight" not in reader
    ):
        return reader
    released = ReleasedReader.__new__(ReleasedReader)
    released.__dict__.update(vars(reader))  # the same open files and key index
    return released


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
    L = cfg.num_hidden_layers
    for i in (*cfg.moe_layers, *model.mtp_layers):  # the MTP module's MoE is layer L + k: `mtp.{k}.ffn`
        pre = f"model.layers.{i}.ffn" if i < L else f"mtp.{i - L}.ffn"
        layer = model.layer(i)
        yield Weight(layer.router.classifier.weight, ((f"{pre}.gate.weight", (E, H)),))
        if layer.router.hashed:
            tid2eid = ((f"{pre}.gate.tid2eid", (cfg.vocab_size, K)),)
            yield Weight(layer.router.tid2eid, tid2eid, _expert_ids(E))
        else:
            yield Weight(layer.router.e_score_correction_bias, ((f"{pre}.gate.bias", (E,)),))
        yield from _experts(layer.experts, f"{pre}.experts", H, I)


def _rows(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts, dim=0)


def _experts(experts, prefix: str, H: int, I: int) -> Iterator[Weight]:
    """Stacked experts from `{prefix}.{e}.w{1,2,3}.weight`: w13[g] = [w1; w3]^T, w2[g] = w2^T, or, quantized
    (afd.model.quant_load), [w1; w3] and w2 in the checkpoint's orientation with their per-row scales."""
    for g, e in enumerate(experts.held):
        x = f"{prefix}.{e}"
        gate_up = ((f"{x}.w1.weight", (I, H)), (f"{x}.w3.weight", (I, H)))
        down = ((f"{x}.w2.weight", (H, I)),)
        if experts.quant is not None:
            yield Weight(experts.w13[g], gate_up, _rows, experts.w13_scale[g])
            yield Weight(experts.w2[g], down, None, experts.w2_scale[g])
        else:
            yield Weight(experts.w13[g], gate_up, _gate_up)
            yield Weight(experts.w2[g], down, torch.t)


_MTP_HC = re.compile(r"^block\.hc_(attn|ffn)\.(fn|base|scale)$")


def mtp_weights(model) -> Iterator[Weight]:
    """The MTP module (afd.model.deepseek_v4.mtp.MTPLayer) from `mtp.0.*`: the block's parameters under the
    decoder layer's leaf names (`attn.*`, `attn_norm`, `ffn.shared_experts.*`, `hc_attn_fn`, ...), its own
    `e_proj`, `h_proj`, `enorm`, `hnorm`, `norm` and `hc_head_{fn,base,scale}`. The same keys in either
    layout: transformers' has no MTP keys at all (it drops `mtp.*`)."""
    for name, p in model.named_parameters():
        if hc := _MTP_HC.match(name):
            key = f"hc_{hc[1]}_{hc[2]}"
        elif name.startswith("hc_head.hc_"):
            key = "hc_head_" + name.removeprefix("hc_head.hc_")
        else:
            key = name.removeprefix("block.")
        yield Weight(p, ((f"mtp.0.{key}", tuple(p.shape)),))
