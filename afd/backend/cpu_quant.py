"""The CPU's quantized GEMMs: int8 x int8 on VNNI through torch._int_mm for w8a8; the reference
(afd.quant.reference) for the rest, said once in the log.

Measured on the development machine (AMD EPYC with AVX-512 VNNI and BF16, one thread, 1024 x 2816 weight,
torch 2.13; /tmp probes, recorded in docs/benchmarks/quantization.md): at 16 rows fp32 F.linear 1.42 ms,
bf16 0.35 ms, torch._int_mm 0.21 ms (0.25 ms with the per-token quantization and rescale); at 1 row 162 /
186 / 39 us. torch._scaled_mm has a CPU kernel but took 12-21 ms (no FP8 GEMM on this CPU), and widening
FP8 to bf16 took 2.8 ms per weight (no vector conversion), so fp8 runs the fp32 reference here: it
models an FP8 device's numerics, not its speed. torch._weight_int8pack_mm (int8 weight, bf16
activations) segfaulted on a 7-column weight in torch 2.13, so w8a16 takes the reference too.

fbgemm's and oneDNN's dynamic quantized linear (torch.ao.nn.quantized.dynamic.Linear, prepacked per-channel
int8 weights) measured faster still in one probe (137 against 343 us at 16 rows with the quantization, on
the same machine under load), but they quantize the activations per tensor (uint8, asymmetric), not per
token as w8a8 is defined, and sit on torch's quantized-tensor API, deprecated since torch 2.13
(pytorch/pytorch#184982). torch._int_mm is the scheme's math on a current op.
"""

from __future__ import annotations

import functools
import logging

import torch

from afd.backend.base import group_slices
from afd.quant.formats import quantize_rows_int8
from afd.quant.scheme import INT8_CHANNEL, QuantSpec

log = logging.getLogger("afd.backend")


@functools.cache
def int_mm_exact() -> bool:
    """Whether torch._int_mm sums int8 products exactly on this CPU. With VNNI (vpdpbusd) it does; held to
    AVX2 (no VNNI: `make test-avx2`, or such a CPU), oneDNN's u8s8 path shifts the activations by 128 and
    vpmaddubsw saturates each pair of products at int16: 127 x 127 summed over 64 measured 8160 for 1032256
    (torch 2.13). The probe is that worst case; where it fails, w8a8 takes the fp32 reference (said once)."""
    x = torch.full((1, 64), 127, dtype=torch.int8)
    w = torch.full((8, 64), 127, dtype=torch.int8)
    return torch.equal(torch._int_mm(x, w.t()), x.int() @ w.int().t())


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w8a8: x [T, K] quantized per token, times q [N, K] int8 (per-channel scale [N, 1]) in int32 on VNNI.
    torch._int_mm (aten _int_mm_out_cpu) takes int8 [T, K] @ int8 [K, N] -> int32 at any shape on CPU
    (checked exact against an int32 matmul at odd sizes and at 0 rows); q.t() is column-major, the
    layout its kernel reads fastest (39 against 109 us at one row)."""
    xq, xs = quantize_rows_int8(x)
    return (torch._int_mm(xq, q.t()).float() * xs * scale.t()).to(x.dtype)


def int8_grouped_matmul(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group_sizes: torch.Tensor
) -> torch.Tensor:
    """w8a8 experts: x [T, K] sorted by group, quantized per token once (not per group: the same rows), then
    torch._int_mm per non-empty group on q [G, N, K] (scale [G, N, 1]); rows past the groups are left as
    they come. The sizes are a CPU tensor: reading them is no sync."""
    xq, xs = quantize_rows_int8(x)
    out = x.new_empty(x.shape[0], q.shape[1])
    for g, rows in group_slices(group_sizes):
        out[rows] = (torch._int_mm(xq[rows], q[g].t()).float() * xs[rows] * scale[g].t()).to(x.dtype)
    return out


def cpu_quant_kernel(spec: QuantSpec) -> str:
    """Which kernels the CPU runs for `spec`'s GEMMs (named in the log once)."""
    if is_w8a8(spec):
        kernels = "torch._int_mm or int8 widened to an fp32 GEMM, chosen per GEMM by timing (afd env)"
        if int_mm_exact():
            return kernels
        return kernels + (
            "; not torch._int_mm, which saturates on this CPU (no VNNI): the int8 weights widen on every call, so"
            " w8a8 decodes about as fast as fp32 or slower here (fp32's weights are held packed), with a quarter of"
            " the memory"
        )
    return "the fp32 reference (afd.quant.reference): no faster CPU kernel for " + spec.method


def is_w8a8(spec: QuantSpec) -> bool:
    return spec.activations == "int8" and spec.weights == INT8_CHANNEL
