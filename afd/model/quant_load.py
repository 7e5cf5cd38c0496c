"""Loading a half's quantized tensors (afd.quant): each destination's 8-bit values and per-row scales from
the checkpoint's FP8 blocks as they are stored, or quantized at load from full-precision tensors.

A quantized destination is in the checkpoint's orientation ([N, K] rows; Experts.quantize), so a family's
`combine` for it only stacks sources' rows (gate | up): applied to the values and to the per-row scales
alike, it keeps each row's scale with the row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from afd.model.experts import Experts
from afd.quant.formats import QUANT_DTYPES, expand_block_scale, quantize_fp8_block, quantize_int8_channel
from afd.quant.scheme import FP8_BLOCK, QuantSpec


class FP8Source(Protocol):
    def get(self, key: str, shape: tuple[int, ...]) -> torch.Tensor: ...
    def get_fp8(self, key: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor] | None: ...


def quantize_half(module: nn.Module, spec: QuantSpec) -> None:
    """Every routed-expert holder of a meta-built half to `spec`'s 8-bit storage."""
    for mod in module.modules():
        if isinstance(mod, Experts):
            mod.quantize(spec)


def is_quantized(name: str, t: torch.Tensor) -> bool:
    """A half's tensor that keeps its dtype when the half is cast: 8-bit values, and their fp32 scales."""
    return t.dtype in QUANT_DTYPES or name.endswith("_scale")


def _source(reader: FP8Source, key: str, shape: tuple[int, ...], spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K], scale [N, Kb]) of one checkpoint tensor as `spec` stores it: the stored FP8 blocks when
    they are what spec asks for, else its full-precision values (dequantized if stored FP8) quantized."""
    if spec.weights == FP8_BLOCK:
        stored = reader.get_fp8(key, shape) if spec.checkpoint is not None else None
        if stored is not None:
            q, scale_inv = stored
            return q, expand_block_scale(scale_inv, shape[0], spec.block[0])
        q, scale = quantize_fp8_block(reader.get(key, shape).float(), spec.block)
        return q, expand_block_scale(scale, shape[0], spec.block[0])
    return quantize_int8_channel(reader.get(key, shape).float())


def load_quantized(
    dest: torch.Tensor,
    scale: torch.Tensor,
    sources: tuple[tuple[str, tuple[int, ...]], ...],
    combine: Callable[..., torch.Tensor] | None,
    reader: FP8Source,
    spec: QuantSpec,
) -> None:
    parts = [_source(reader, key, shape, spec) for key, shape in sources]
    q = combine(*(p[0] for p in parts)) if combine is not None else parts[0][0]
    s = combine(*(p[1] for p in parts)) if combine is not None else parts[0][1]
    if tuple(q.shape) != tuple(dest.shape) or tuple(s.shape) != tuple(scale.shape):
        raise ValueError(
            f"quantized {sources[0][0]}: values {tuple(q.shape)} and scales {tuple(s.shape)} do not fit "
            f"{tuple(dest.shape)} and {tuple(scale.shape)}"
        )
    with torch.no_grad():
        dest.copy_(q)
        scale.copy_(s)
