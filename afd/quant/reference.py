"""The quantized GEMMs as plain torch: what every backend runs where it has no fused kernel for a case,
and what the fused kernels are held to.

Weights are in the checkpoint's orientation (afd.quant.formats): q [N, K] (or [G, N, K] stacked), scale
[N, Kb]. Activations are quantized per token as the scheme says (QuantSpec.activations), then everything
is widened to fp32, multiplied and summed there (the products of 8-bit values are exact in fp32), and
rounded once to x's dtype. Without activation quantization (w8a16) the dequantized weight is rounded to
x's dtype first: F.linear on the same weight a dequantized checkpoint gives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from afd.quant.formats import block_k, dequantize, quantize_rows_fp8, quantize_rows_int8

if TYPE_CHECKING:
    from afd.quant.scheme import QuantSpec


def quantized_activations(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """x [T, K] as the GEMM sees it: quantized per token and widened back to fp32 (fp8 or int8), or x."""
    if spec.activations == "int8":
        q, s = quantize_rows_int8(x)
        return q.float() * s
    if spec.activations == "fp8":
        q, s = quantize_rows_fp8(x, spec.block[1])
        return dequantize(q, s, spec.block[1])
    return x


def quant_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """x [T, K] @ (q [N, K], scale [N, Kb])^T -> [T, N] in x's dtype."""
    bk = block_k(spec.weights, spec.block, q.shape[-1])
    if spec.activations is None:
        return F.linear(x, dequantize(q, scale, bk, x.dtype))
    return F.linear(quantized_activations(x, spec), dequantize(q, scale, bk)).to(x.dtype)
