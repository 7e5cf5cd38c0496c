"""The fake torch_npu quantized 2-D ops, and the helpers ops_quant_gmm.py shares: npu_dynamic_quant, npu_quant_matmul
and npu_weight_quant_batchmatmul (ops_quant.py registers them; its docstring says what is modelled and what not).

sources (read 2026-12-02):
  doc: https://github.com/Ascend/op-plugin/blob/7.1.0/docs/context/torch_npu-npu_quant_matmul.md,
    .../torch_npu-npu_dynamic_quant.md, .../torch_npu-npu_weight_quant_batchmatmul.md
    (op-plugin 7.1.0); the same names under .../blob/26.0.0/docs/en/custom_APIs/torch_npu/ (26.0.0, whose
    npu_dynamic_quant page states the formula as text, the 7.1.0 one as an image)
  schema: op_plugin/config/op_plugin_functions.yaml @7.1.0 (npu_quant_matmul, npu_dynamic_quant,
    npu_weight_quant_batchmatmul)
Not documented, so chosen here: an all-zero row's dynamic quantization (the formula divides 0 by 0) gives y 0 and
scale 0; the fake-quantized weight is rounded to x's dtype before the Cube multiplies it.
"""

from __future__ import annotations

import torch

if not hasattr(torch.ops.fake_npu, "calls"):  # the call log ops.py keeps on the namespace
    torch.ops.fake_npu.calls = []
calls: list[tuple] = torch.ops.fake_npu.calls

SCHEMAS = {
    "npu_dynamic_quant": (
        "npu_dynamic_quant(Tensor input, *, Tensor? smooth_scales=None, Tensor? group_index=None, "
        "ScalarType? dst_type=None) -> (Tensor, Tensor)"
    ),
    "npu_quant_matmul": (
        "npu_quant_matmul(Tensor x1, Tensor x2, Tensor scale, *, Tensor? offset=None, Tensor? pertoken_scale=None, "
        "Tensor? bias=None, ScalarType? output_dtype=None, SymInt[]? group_sizes=None) -> Tensor"
    ),
    "npu_weight_quant_batchmatmul": (
        "npu_weight_quant_batchmatmul(Tensor x, Tensor weight, Tensor antiquant_scale, Tensor? antiquant_offset=None, "
        "Tensor? quant_scale=None, Tensor? quant_offset=None, Tensor? bias=None, int antiquant_group_size=0, "
        "int inner_precise=0) -> Tensor"
    ),
}
HALF = (torch.float16, torch.bfloat16)
QMM_LAST_DIM_MAX = 65535  # doc npu_quant_matmul: the last dim of x1 and x2 at most 65535
WQBMM_DIM_RANGE = (1, 65535)  # doc npu_weight_quant_batchmatmul: K and N in [1, 65535]
# doc npu_quant_matmul table 2 (A2/A3), the rows with a pertoken_scale: (scale dtype, output dtype)
QMM_PERTOKEN = {(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)}


def _fail(msg: str) -> None:
    raise RuntimeError(msg)


def _nd_or_transposed(t: torch.Tensor) -> bool:
    """A contiguous [.., K, N], or the transpose of a contiguous [.., N, K] (the doc's two layouts of a weight)."""
    return t.is_contiguous() or t.transpose(-1, -2).is_contiguous()


# ---- npu_dynamic_quant --------------------------------------------------------------------------------------------


def _dq_checks(x, smooth_scales, group_index, dst_type) -> None:
    if smooth_scales is not None or group_index is not None:
        raise NotImplementedError("fake npu_dynamic_quant: smooth_scales / group_index are not modelled")
    if dst_type not in (None, torch.int8):  # doc: int8 or quint4x2 (int4 packed in int32, not modelled)
        if dst_type == torch.quint4x2:
            raise NotImplementedError("fake npu_dynamic_quant: quint4x2 is not modelled")
        _fail(f"npu_dynamic_quant: dst_type must be int8 or quint4x2, got {dst_type}")
    if x.dtype not in HALF:  # doc: x float16 or bfloat16
        _fail(f"npu_dynamic_quant: x must be float16 or bfloat16, got {x.dtype}")
    if x.dim() <= 1:  # doc: x's dims must be more than 1
        _fail(f"npu_dynamic_quant: x must have more than 1 dim, got {x.dim()}")


def _dq_kernel(input, *, smooth_scales=None, group_index=None, dst_type=None):
    _dq_checks(input, smooth_scales, group_index, dst_type)
    xf = input.float()
    scale = xf.abs().amax(dim=-1) / 127.0  # [..]: rowMax(|x|) / DTYPE_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.round(xf / safe.unsqueeze(-1)).clamp(-128, 127).to(torch.int8)
    calls.append(("npu_dynamic_quant", tuple(input.shape)))
    return y, scale


def _dq_meta(input, *, smooth_scales=None, group_index=None, dst_type=None):
    _dq_checks(input, smooth_scales, group_index, dst_type)
    return input.new_empty(input.shape, dtype=torch.int8), input.new_empty(input.shape[:-1], dtype=torch.float32)


# ---- npu_quant_matmul ---------------------------------------------------------------------------------------------


def _qmm_checks(x1, x2, scale, offset, pertoken_scale, bias, output_dtype, group_sizes) -> None:
    if x1.dtype == torch.int32 or x2.dtype == torch.int32 or group_sizes:
        raise NotImplementedError("fake npu_quant_matmul: int4 (int32-packed) inputs are not modelled")
    if bias is not None:
        raise NotImplementedError("fake npu_quant_matmul: bias is not modelled")
    if pertoken_scale is None:
        raise NotImplementedError("fake npu_quant_matmul: static scales (no pertoken_scale) are not modelled")
    if x1.dtype != torch.int8 or x2.dtype != torch.int8:  # doc: int8 (or int32) on A2/A3, x2 as x1
        _fail(f"npu_quant_matmul: x1 and x2 must be int8, got {x1.dtype} and {x2.dtype}")
    if x1.dim() != 2 or x2.dim() != 2:  # doc: 2-6 dims; afd's are 2-D, the batched forms are not modelled
        raise NotImplementedError("fake npu_quant_matmul: only 2-D x1 and x2 are modelled")
    if x1.numel() == 0 or x2.numel() == 0 or scale.numel() == 0:  # doc: x1, x2 and scale must not be empty
        _fail("npu_quant_matmul: x1, x2 and scale must not be empty")
    (m, k), (k2, n) = x1.shape, x2.shape
    if k != k2:
        _fail(f"npu_quant_matmul: x1's K {k} != x2's K {k2} (x2 is [K, N])")
    if max(x1.shape[-1], x2.shape[-1]) > QMM_LAST_DIM_MAX:  # doc: last dims at most 65535
        _fail(f"npu_quant_matmul: the last dim of x1 and x2 must be at most {QMM_LAST_DIM_MAX}, got {k} and {n}")
    if not _nd_or_transposed(x2):  # doc: ND; the examples pass (k, n) or the .t() of a contiguous (n, k)
        _fail("npu_quant_matmul: x2 must be a contiguous (k, n) or the transpose of a contiguous (n, k)")
    if scale.dim() != 1 or scale.shape[0] not in (1, n):  # doc: scale 1-D (t,), t = 1 or n
        _fail(f"npu_quant_matmul: scale must be 1-D of length 1 or n={n}, got {tuple(scale.shape)}")
    if offset is not None:  # doc table 2: offset only with int8 output and no pertoken_scale
        _fail("npu_quant_matmul: offset must be None with a pertoken_scale")
    if pertoken_scale.dtype != torch.float32 or tuple(pertoken_scale.shape) != (m,):  # doc: float32 (m,)
        _fail(f"npu_quant_matmul: pertoken_scale must be float32 of shape ({m},), got {pertoken_scale.dtype} "
              f"{tuple(pertoken_scale.shape)}")  # fmt: skip
    if (scale.dtype, output_dtype) not in QMM_PERTOKEN:  # doc table 2; None means int8, not a pertoken row
        _fail(
            f"npu_quant_matmul: with a pertoken_scale, (scale, output_dtype) must be one of (float32|bfloat16, "
            f"bfloat16) or (float32, float16), got ({scale.dtype}, {output_dtype})"
        )


def _int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 [.., K] @ int8 [K, N] -> the exact int32 sums, held in float64 (exact below 2^53: K < 2^39 here)."""
    return a.double() @ b.double()


def _qmm_kernel(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None, group_sizes=None):
    _qmm_checks(x1, x2, scale, offset, pertoken_scale, bias, output_dtype, group_sizes)
    acc = _int_mm(x1, x2).float()  # the int32 sums as the kernel's fp32 dequantization reads them
    y = acc * scale.float() * pertoken_scale.unsqueeze(-1)  # (x1 @ x2) * scale * pertoken_scale, in fp32
    calls.append(("npu_quant_matmul", scale.dtype, output_dtype))
    return y.to(output_dtype)


def _qmm_meta(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None, group_sizes=None):
    _qmm_checks(x1, x2, scale, offset, pertoken_scale, bias, output_dtype, group_sizes)
    return x1.new_empty((x1.shape[0], x2.shape[1]), dtype=output_dtype)


# ---- npu_weight_quant_batchmatmul ----------------------------------------------------------------------------------


def _wq_checks(x, weight, antiquant_scale, antiquant_offset, quant_scale, quant_offset, bias, group_size, precise):
    if quant_scale is not None or quant_offset is not None:
        raise NotImplementedError("fake npu_weight_quant_batchmatmul: quant_scale / quant_offset are not modelled")
    if group_size != 0 or weight.dtype == torch.int32 or antiquant_scale.dtype == torch.int64:
        raise NotImplementedError("fake npu_weight_quant_batchmatmul: per-group, int4 and int64 scales not modelled")
    if x.dtype not in HALF:  # doc A2/A3: x float16 or bfloat16
        _fail(f"npu_weight_quant_batchmatmul: x must be float16 or bfloat16, got {x.dtype}")
    if weight.dtype != torch.int8:  # doc A2/A3: weight int8 (or int32-packed int4)
        _fail(f"npu_weight_quant_batchmatmul: weight must be int8, got {weight.dtype}")
    if x.dim() != 2 or weight.dim() != 2:  # doc: x (M, K), weight (K, N)
        _fail("npu_weight_quant_batchmatmul: x and weight must be 2-D (M, K) and (K, N)")
    (_, k), (k2, n) = x.shape, weight.shape
    if k != k2:
        _fail(f"npu_weight_quant_batchmatmul: x's K {k} != weight's K {k2}")
    if x.numel() == 0 or weight.numel() == 0:  # doc: no empty tensor
        _fail("npu_weight_quant_batchmatmul: empty tensors are not supported")
    lo, hi = WQBMM_DIM_RANGE
    if not (lo <= k <= hi and lo <= n <= hi):  # doc: K and N in [1, 65535]
        _fail(f"npu_weight_quant_batchmatmul: K and N must be in [{lo}, {hi}], got {k} and {n}")
    if not _nd_or_transposed(weight):  # doc: ND, transposed non-contiguous tensors allowed
        _fail("npu_weight_quant_batchmatmul: weight must be a contiguous (K, N) or its transpose's view")
    # doc: per-tensor (1,) / (1, 1); per-channel (N,) / (1, N); dtype float16/bfloat16 equal to x's (single-op mode)
    if tuple(antiquant_scale.shape) not in ((1,), (1, 1), (n,), (1, n)):
        _fail(f"npu_weight_quant_batchmatmul: antiquant_scale shape {tuple(antiquant_scale.shape)} is neither "
              f"per-tensor nor per-channel for N={n}")  # fmt: skip
    if antiquant_scale.dtype != x.dtype:
        _fail(f"npu_weight_quant_batchmatmul: antiquant_scale dtype {antiquant_scale.dtype} != x dtype {x.dtype}")
    if antiquant_offset is not None and (
        antiquant_offset.shape != antiquant_scale.shape or antiquant_offset.dtype != antiquant_scale.dtype
    ):  # doc: antiquant_offset's shape as antiquant_scale's, dtype as antiquant_scale's (float16/bfloat16)
        _fail("npu_weight_quant_batchmatmul: antiquant_offset must match antiquant_scale's shape and dtype")
    if bias is not None:  # doc: (1, N) or (N,); float32 for bfloat16 x, float16 for float16 x
        want = torch.float32 if x.dtype == torch.bfloat16 else torch.float16
        if tuple(bias.shape) not in ((n,), (1, n)) or bias.dtype != want:
            _fail(f"npu_weight_quant_batchmatmul: bias must be {want} of shape ({n},) or (1, {n})")
    if precise not in (0, 1):  # doc: 0 high precision, 1 high performance
        _fail(f"npu_weight_quant_batchmatmul: inner_precise must be 0 or 1, got {precise}")


def _antiquant(w: torch.Tensor, scale: torch.Tensor, offset, dtype: torch.dtype) -> torch.Tensor:
    """(w + offset) * scale in fp32, rounded to x's dtype (the Cube then multiplies in that dtype)."""
    wf = w.float() if offset is None else w.float() + offset.float()
    return (wf * scale.float()).to(dtype)


def _wq_kernel(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None, quant_offset=None, bias=None,
               antiquant_group_size=0, inner_precise=0):  # fmt: skip
    _wq_checks(x, weight, antiquant_scale, antiquant_offset, quant_scale, quant_offset, bias,
               antiquant_group_size, inner_precise)  # fmt: skip
    offset = None if antiquant_offset is None else antiquant_offset.reshape(1, -1)
    w = _antiquant(weight, antiquant_scale.reshape(1, -1), offset, x.dtype)
    y = x.float() @ w.float()  # fp32 accumulation
    if bias is not None:
        y = y + bias.float().reshape(1, -1)
    calls.append(("npu_weight_quant_batchmatmul", x.dtype))
    return y.to(x.dtype)


def _wq_meta(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None, quant_offset=None, bias=None,
             antiquant_group_size=0, inner_precise=0):  # fmt: skip
    _wq_checks(x, weight, antiquant_scale, antiquant_offset, quant_scale, quant_offset, bias,
               antiquant_group_size, inner_precise)  # fmt: skip
    return x.new_empty((x.shape[0], weight.shape[1]))
