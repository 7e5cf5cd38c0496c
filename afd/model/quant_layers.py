"""The attention side's quantized linears: nn.Linear's call on 8-bit weights, through the backend's
quantized GEMM (Backend.quant_matmul).

The attention half loads in full precision and is cut for TP first (afd.model.tp.shard slices nn.Linear
rows); afd.engine.factory then quantizes its linears here, once, from the loaded values. Left in the model
dtype, and why:
- with w8a16: every linear (activations in dtype: the same numbers as widening inside the GEMM, and the
  attention side's weights are a small share of an AFD deployment's; the experts are 8-bit);
- kv_b_proj: MLA absorbs it into the queries and outputs (afd.model.mla reads its weight, not its call);
- lm_head and embeddings (as in the released checkpoints), TP's row-parallel layers (not nn.Linear);
- an MLA whose backend fuses its prolog (it takes the projections' weights in dtype);
- modules the checkpoint's quantization_config leaves out (modules_to_not_convert).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from afd.backend import Backend
from afd.quant.formats import expand_block_scale, quantize_fp8_block, quantize_int8_channel
from afd.quant.scheme import FP8_BLOCK, QuantSpec

log = logging.getLogger("afd.model")

KEPT = ("kv_b_proj", "lm_head")
"""Linears that stay in the model dtype whatever the scheme (see the module's docstring)."""


class QuantLinear(nn.Module):
    """y = x W^T + b with W held as (weight [N, K] 8-bit, weight_scale fp32 [N, Kb]: afd.quant.formats)."""

    weight_scale: torch.Tensor

    def __init__(self, linear: nn.Linear, spec: QuantSpec, backend: Backend):
        super().__init__()
        w = linear.weight.detach()
        if spec.weights == FP8_BLOCK:
            q, s = quantize_fp8_block(w.float(), spec.block)
            s = expand_block_scale(s, w.shape[0], spec.block[0])
        else:
            q, s = quantize_int8_channel(w)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.register_buffer("weight_scale", s)
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.spec, self.backend = spec, backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.backend.quant_matmul(x.reshape(-1, self.in_features), self.weight, self.weight_scale, self.spec)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def quantize_linears(module: nn.Module, spec: QuantSpec, backend: Backend, keep: tuple[str, ...] = ()) -> int:
    """Every quantizable nn.Linear of a loaded (and TP-cut) half to a QuantLinear, in place; returns how many.
    Idempotent: a QuantLinear is not an nn.Linear. keep: name fragments left alone (the half's `unquantized`)."""
    if spec.activations is None:
        return 0
    skip = (*(spec.checkpoint.not_converted if spec.checkpoint is not None else ()), *keep)
    fused = {
        id(m) for m in module.modules() if getattr(m, "prolog", None) is not None
    }  # an MLA with the backend's fused prolog
    done = 0
    for parent_name, parent in list(module.named_modules()):
        if id(parent) in fused:
            continue
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if not isinstance(child, nn.Linear) or name in KEPT or any(s in full for s in skip):
                continue
            if child.weight.device.type == "meta":
                continue
            setattr(parent, name, QuantLinear(child, spec, backend))
            done += 1
    return done
