"""CUDA's quantized GEMMs: which torch kernel each scheme takes, gated by pure functions of the GPU and the
shapes (tested on CPU: tests/test_cuda_quant.py), and the fallbacks where a gate says no.

- fp8 (FP8 weights per block, FP8 activations per token and 128-wide K group): torch.nn.functional.scaled_mm
  with BlockWise1x128 scales on both sides (cuBLASLt's 1D block scaling; the "DeepSeek recipe" pairs of
  pytorch's ScaledBlas.cpp). afd keeps a scale per output row and K block (afd.quant.formats), which is
  exactly B's 1x128 scaling, so TP shards and gate|up rows cut anywhere need no 128-row alignment.
  Elsewhere (not sm90, cuBLAS < 12.9, K not whole 128-blocks): dequantize to the model dtype and matmul,
  the activations still rounded through FP8 so that the numerics stay the scheme's.
- w8a8 (int8 weights per channel, int8 activations per token): torch._int_mm (cuBLASLt int8 -> int32),
  rescaled in fp32. Fewer than 17 rows are padded to 17 (the kernel refuses M <= 16).
- w8a16: the weight dequantized to the model dtype, then F.linear (afd.quant.reference's own path).
- Experts (quant_grouped_matmul): one GEMM per group, sizes read on the host. torch._scaled_grouped_mm takes
  FP8 with row-wise fp32 scales (one per row of A, one per column of each B) or MXFP8 e8m0 scales only
  (torch 2.13 torch/_meta_registrations.py, _meta_grouped_mm_common: "Expected scale_a to be 1D tensor"),
  which fits neither fp8's 1x128 groups nor int8, so no fused grouped kernel serves these formats.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from afd.quant import reference
from afd.quant.formats import block_k, dequantize, quantize_rows_fp8, quantize_rows_int8
from afd.quant.scheme import FP8_BLOCK, INT8_CHANNEL, QuantConfigError, QuantSpec

log = logging.getLogger("afd.backend")

FP8_MIN_CAPABILITY = (8, 9)
"""pytorch aten/src/ATen/native/cuda/ScaledBlas.cpp (_scaled_mm_out_cuda): "torch._scaled_mm is only supported
on CUDA devices with compute capability >= 9.0 or 8.9" (pytorch/pytorch at 0174dfab, the copy the code index
holds; the 2.13 tag itself was not read)."""
BLOCKWISE_CUBLAS = (12, 9)
"""ScaledBlas.cpp (_check_deepseek_support): "DeepSeek style (1x128, 128x128) scaling only supported in CUDA for
SM90" (dprops->major == 9: Blackwell falls back too) and "requires cublasLt >= 12.9" (same copy). torch.version.cuda
stands in for the cuBLAS version, which Python cannot read."""
INT_MM_MIN_ROWS = 17
"""pytorch aten/src/ATen/native/cuda/Blas.cpp (_int_mm_out_cuda): "self.size(0) needs to be greater than 16";
K and N "greater than 0 and a multiple of 8" (the same in every copy of Blas.cpp the code index holds; the
2.13 tag itself was not read; the CPU kernel takes any shape)."""


@dataclass(frozen=True)
class CudaQuantEnv:
    """What the gates read of the machine: kept apart so that tests can name any GPU."""

    capability: tuple[int, int] | None
    hip: bool
    cuda: str | None
    """torch.version.cuda: the toolkit torch was built with, whose cuBLAS (CUBLAS_VERSION) it ships against."""
    scaled_mm_v2: bool
    """torch.nn.functional.scaled_mm (with ScalingType) exists in this torch."""

    @classmethod
    def of(cls, device: torch.device) -> CudaQuantEnv:
        return cls(
            torch.cuda.get_device_capability(device),
            bool(torch.version.hip),
            torch.version.cuda,
            hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"),
        )


def _sm(capability: tuple[int, int] | None) -> str:
    return "unknown" if capability is None else f"sm_{capability[0]}{capability[1]}"


def _version(s: str | None) -> tuple[int, int]:
    parts = (s or "0.0").split(".")
    return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0


def fp8_refusal(env: CudaQuantEnv, spec: QuantSpec) -> str | None:
    """Why this GPU cannot serve `spec` at all (None: it can). Only fp8 is refused: its activations are FP8 by
    definition, and a GPU without FP8 tensor cores would run it as a slower, less accurate w8a16."""
    if spec.activations != "fp8":
        return None
    src = "an FP8 checkpoint served as fp8 (its default)" if spec.checkpoint else "--quantization fp8"
    if not env.hip and (env.capability is None or env.capability < FP8_MIN_CAPABILITY):
        return (
            f"{src} needs FP8 tensor cores (CUDA compute capability >= 8.9: Ada, Hopper, Blackwell); this GPU is "
            f"{_sm(env.capability)}. Serve with --quantization w8a16: it keeps the FP8 weights and widens them "
            "inside the GEMM"
        )
    if spec.weights == FP8_BLOCK and spec.block[1] != 128:
        return (
            f"{src}: weight_block_size {list(spec.block)} has K blocks of {spec.block[1]}; CUDA's block-scaled FP8 "
            "GEMM takes 128-wide K groups only. Serve with --quantization w8a16 (any block size)"
        )
    return None


def why_not_fp8_blockwise(env: CudaQuantEnv, block: tuple[int, int], k: int, n: int) -> str | None:
    """Why F.scaled_mm's 1x128 x 1x128 block-scaled FP8 GEMM does not take x [T, k] @ w [n, k]^T (None: it does).
    ScaledBlas.cpp: _check_deepseek_support (sm90, cublasLt >= 12.9; not ROCm), _scaled_mm_out_cuda ("trailing
    dimension of mat1 ... divisible by 16", mat2's both dimensions too, mat2 column-major: we pass w.t()); torch
    2.13 torch/_meta_registrations.py (_check_scaled_mm_sizes_v2, is_1x128_1x128) sizes the scales by K // 128,
    so K must be whole 128-blocks."""
    if env.hip:
        return "ROCm: no 1x128 block-scaled FP8 GEMM in torch"
    if not env.scaled_mm_v2:
        return "this torch has no torch.nn.functional.scaled_mm"
    if env.capability is None or env.capability[0] != 9:
        return "block-scaled FP8 GEMM (1x128 scales) runs on sm90 only"
    if _version(env.cuda) < BLOCKWISE_CUBLAS:
        return f"block-scaled FP8 GEMM needs cuBLAS >= 12.9 (torch built with CUDA {env.cuda})"
    if block[1] != 128:
        return f"K blocks of {block[1]}, not 128"
    if k <= 0 or k % 128:
        return f"K = {k} is not a multiple of 128"
    if n <= 0 or n % 16:
        return f"N = {n} is not a multiple of 16"
    return None


def why_not_int_mm(env: CudaQuantEnv, k: int, n: int) -> str | None:
    """Why torch._int_mm does not take x [T, k] int8 @ w [n, k]^T int8 (None: it does; T is padded to 17 rows)."""
    if env.hip:
        return "ROCm: torch._int_mm's CUDA constraints are not checked there"
    if k <= 0 or k % 8:
        return f"K = {k} is not a multiple of 8"
    if n <= 0 or n % 8:
        return f"N = {n} is not a multiple of 8"
    return None


def fp8_blockwise_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, K] quantized per token and 128-group (afd.quant.formats.quantize_rows_fp8) @ (q [N, K] fp8, scale
    [N, K // 128])^T -> [T, N] x.dtype, on F.scaled_mm's BlockWise1x128 x BlockWise1x128 recipe. Its scales
    are outer-dim-major: scale_a [T, Kb] with strides (1, T), scale_b [N, Kb] with strides (1, N)."""
    T, N = x.shape[0], q.shape[0]
    if T == 0:
        return x.new_empty(0, N)
    xq, xs = quantize_rows_fp8(x, 128)  # [T, K] contiguous (K % 128 == 0), [T, Kb]
    scale_a, scale_b = _outer_major(xs), _outer_major(scale.float())
    bw = F.ScalingType.BlockWise1x128
    return F.scaled_mm(xq, q.t(), scale_a, bw, scale_b, bw, output_dtype=x.dtype, use_fast_accum=False)


def _outer_major(s: torch.Tensor) -> torch.Tensor:
    """s [R, Kb] with strides (1, R), which the CUDA check wants exactly, even at R == 1 (where .t().contiguous()
    would keep the strides it has): Kb rows of R, contiguous, viewed transposed."""
    return s.t().clone(memory_format=torch.contiguous_format).as_strided(s.shape, (1, s.shape[0]))


def fp8_dequant_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bk: int) -> torch.Tensor:
    """The fallback: x through FP8 per token and `bk`-group and back, times the weight dequantized to x.dtype
    (both in x.dtype, one F.linear). Costs a weight-sized temporary per call."""
    xq, xs = quantize_rows_fp8(x, bk)
    return F.linear(dequantize(xq, xs, bk, x.dtype), dequantize(q, scale, bk, x.dtype))


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, K] quantized per token @ (q [N, K] int8, scale [N, 1])^T in int32 by torch._int_mm, rescaled in
    fp32 -> [T, N] x.dtype. q.t() is column-major, the layout cuBLASLt's int8 GEMM wants (transa 't',
    transb 'n'); rows are zero-padded to INT_MM_MIN_ROWS (exact: int32 sums, padded rows dropped)."""
    T = x.shape[0]
    xq, xs = quantize_rows_int8(x)
    if T < INT_MM_MIN_ROWS:
        xq = torch.cat([xq, xq.new_zeros(INT_MM_MIN_ROWS - T, xq.shape[1])])
    acc = torch._int_mm(xq, q.t())[:T]
    return (acc.float() * xs * scale.float().t()).to(x.dtype)


def kernel_for(env: CudaQuantEnv, spec: QuantSpec, k: int, n: int) -> tuple[str, str | None]:
    """(kernel name, why the fast one is not taken or None) for one GEMM of `spec` with weight [n, k]."""
    if spec.activations == "fp8":
        why = why_not_fp8_blockwise(env, spec.block, k, n)
        return ("F.scaled_mm BlockWise1x128 x BlockWise1x128", None) if why is None else ("FP8 dequantized + mm", why)
    if spec.activations == "int8" and spec.weights == INT8_CHANNEL:
        why = why_not_int_mm(env, k, n)
        return ("torch._int_mm (int8 -> int32)", None) if why is None else ("int8 dequantized + mm", why)
    return "dequantized to the model dtype + mm", None


_said: set[tuple] = set()


def quant_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, spec: QuantSpec, env: CudaQuantEnv):
    """Backend.quant_matmul on CUDA: the kernel kernel_for picks, its fallback named once per shape in the log."""
    n, k = q.shape
    name, why = kernel_for(env, spec, k, n)
    if (spec.method, k, n) not in _said:
        _said.add((spec.method, k, n))
        log.info("quantized GEMM %s [%d -> %d] on CUDA: %s%s", spec.method, k, n, name, f" ({why})" if why else "")
    if spec.activations == "fp8":
        if why is None:
            return fp8_blockwise_matmul(x, q, scale)
        return fp8_dequant_matmul(x, q, scale, block_k(spec.weights, spec.block, k))
    if spec.activations == "int8" and why is None:
        return int8_matmul(x, q, scale)
    return reference.quant_matmul(x, q, scale, spec)


def check_quantization(spec: QuantSpec, env: CudaQuantEnv) -> None:
    """Backend.check_quantization on CUDA: refuse (QuantConfigError) what fp8_refusal names; log the plan."""
    refusal = fp8_refusal(env, spec)
    if refusal is not None:
        raise QuantConfigError(refusal)
    if spec.activations == "fp8":
        why = why_not_fp8_blockwise(env, spec.block, 128, 128)
        dense = "F.scaled_mm 1x128 x 1x128 block-scaled FP8 (cuBLASLt) where K % 128 == 0 and N % 16 == 0"
        dense = dense if why is None else f"FP8 dequantized to the model dtype + mm ({why})"
    elif spec.activations == "int8" and spec.weights == INT8_CHANNEL:
        why = why_not_int_mm(env, 8, 8)
        dense = "torch._int_mm where K and N are multiples of 8" if why is None else f"dequantized + mm ({why})"
    else:
        dense = "weights dequantized to the model dtype + mm"
    log.info(
        "quantization %s; on CUDA %s: linears take %s; experts one GEMM per expert (group sizes read on the host: "
        "torch._scaled_grouped_mm takes row-wise or MX scales only)",
        spec.describe(),
        _sm(env.capability),
        dense,
    )
