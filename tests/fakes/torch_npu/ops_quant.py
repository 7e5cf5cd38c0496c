"""Fake torch_npu quantized GEMMs, for tests only: the real signatures, the documented constraints, exact numerics.

What afd's NpuBackend calls for --quantization w8a8 and w8a16 (afd/backend/npu_quant.py), modelled at the release
ops.py models (op-plugin 7.1.0, Atlas A2/A3); the 26.0.0 documents say the same unless a comment says otherwise:
  npu_dynamic_quant(x)                     per-token symmetric int8: scale = rowMax(|x|) / 127, y = round(x / scale)
  npu_quant_matmul(x1, x2, scale, pertoken_scale=...)       y = (x1 @ x2) * scale * pertoken_scale
  npu_weight_quant_batchmatmul(x, weight, antiquant_scale)  y = x @ ((weight + antiquant_offset) * antiquant_scale)
  npu_grouped_matmul, its per-token quantization and its fake-quantization (antiquant) scenarios, single x, single
  3-D weight, single y (the one form afd uses; the unquantized op stays in ops_grouped_matmul.py)

sources (read 2026-12-02):
  doc: https://github.com/Ascend/op-plugin/blob/7.1.0/docs/context/torch_npu-npu_quant_matmul.md,
    .../torch_npu-npu_dynamic_quant.md, .../torch_npu-npu_weight_quant_batchmatmul.md,
    .../torch_npu-npu_grouped_matmul.md
    (op-plugin 7.1.0); the same names under .../blob/26.0.0/docs/en/custom_APIs/torch_npu/ (26.0.0, whose
    npu_dynamic_quant page states the formula as text, the 7.1.0 one as an image)
  schema: op_plugin/config/op_plugin_functions.yaml @7.1.0 (npu_quant_matmul, npu_dynamic_quant,
    npu_weight_quant_batchmatmul; npu_grouped_matmul is ops_grouped_matmul.py's)
  aclnnGroupedMatmulV4 (the kernel npu_grouped_matmul calls): CANN ops-transformer gmm/grouped_matmul/docs/
    aclnnGroupedMatmulV4.md and op_host/op_api/aclnn_grouped_matmul.cpp (CheckOptionalTensorList: a single 3-D
    weight's scale / antiquant_scale / antiquant_offset is [g, n]; CheckPerTokenScale: per_token_scale one 1-D
    [m] tensor, x / weight / y single; CheckGroupedMatmulAntiQuant: antiquant_offset must not be null), read at
    repo-mirror-test/ops-transformer @bfbbec8
Not documented, so chosen here: an all-zero row's dynamic quantization (the formula divides 0 by 0) gives y 0 and
scale 0; the fake-quantized weight is rounded to x's dtype before the Cube multiplies it.

Paths afd does not take (int4, static per-channel scales, bias, smoothing, List group lists) raise
NotImplementedError, so that a test never passes on them by accident; a documented rule broken raises RuntimeError.
"""

from __future__ import annotations

import torch

NAMESPACE = "fake_npu"
if not hasattr(torch.ops.fake_npu, "calls"):  # the call log ops.py keeps on the namespace
    torch.ops.fake_npu.calls = []
calls: list[tuple] = torch.ops.fake_npu.calls

_GMM_ARGS = (
    "(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
    "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
    "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
    "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
    "int? group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, "
    "ScalarType? output_dtype=None) -> Tensor[]"
)
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
    # torch_npu has one npu_grouped_matmul; the fake registers its quantized scenarios under a second name, which
    # the Python entry point below routes to, so that ops_grouped_matmul.py's unquantized op stays as it is.
    "npu_grouped_matmul_quantized": "npu_grouped_matmul_quantized" + _GMM_ARGS,
}
HALF = (torch.float16, torch.bfloat16)
QMM_LAST_DIM_MAX = 65535  # doc npu_quant_matmul: the last dim of x1 and x2 at most 65535
WQBMM_DIM_RANGE = (1, 65535)  # doc npu_weight_quant_batchmatmul: K and N in [1, 65535]
GMM_MAX_GROUPS, GMM_INNER_LIMIT = 1024, 65536  # doc npu_grouped_matmul (as ops_grouped_matmul_rules.py)
# doc npu_quant_matmul table 2 (A2/A3), the rows with a pertoken_scale: (scale dtype, output dtype)
QMM_PERTOKEN = {(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)}
# doc npu_grouped_matmul table 2 (Tensor group_list), per-token rows: scale bfloat16 -> bfloat16, float32 -> float16
GMM_PERTOKEN = {(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)}


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


# ---- npu_grouped_matmul: per-token quantization and fake quantization, single x / weight / y ----------------------


def _gmm_checks(x, weight, bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale, group_list,
                activation_input, activation_quant_scale, activation_quant_offset, split_item, group_type,
                group_list_type, act_type, tuning_config, output_dtype) -> str:  # fmt: skip
    """The documented rules shapes, dtypes and arguments decide; returns "pertoken" or "antiquant"."""
    for name, v in (("offset", offset), ("activation_input", activation_input),
                    ("activation_quant_scale", activation_quant_scale),
                    ("activation_quant_offset", activation_quant_offset)):  # fmt: skip
        if v:  # doc: only None
            _fail(f"npu_grouped_matmul: {name} only supports None")
    if bias or tuning_config or act_type != 0:
        raise NotImplementedError("fake npu_grouped_matmul (quantized): bias, tuning_config, act_type not modelled")
    if group_type != 0 or len(x) != 1 or len(weight) != 1 or weight[0].dim() != 3:
        raise NotImplementedError("fake npu_grouped_matmul (quantized): only group_type 0 single-single-single")
    if split_item not in (2, 3):  # doc, group_type 0 single-single-single: split_item 2 or 3
        _fail(f"npu_grouped_matmul: single-single-single requires split_item 2 or 3, got {split_item}")
    if group_list_type not in (0, 1):  # 2 is documented for int8 only; afd does not use it
        raise NotImplementedError(f"fake npu_grouped_matmul (quantized): group_list_type {group_list_type}")
    (a,), (w,) = x, weight
    g, k, n = w.shape
    if a.dim() != 2 or a.shape[1] != k:  # doc: x 2-D [m, k], weight [g, k, n]
        _fail(f"npu_grouped_matmul: x {tuple(a.shape)} does not match weight {tuple(w.shape)} ([g, k, n])")
    if a.stride(-1) != 1:  # doc: x does not support transposition
        _fail("npu_grouped_matmul: x must not be transposed")
    if not _nd_or_transposed(w):  # doc: weight ND, transposition allowed
        _fail("npu_grouped_matmul: weight must be contiguous [g, k, n] or a transposed view of [g, n, k]")
    inner = k if not w.is_contiguous() else n  # doc: InnerLimit on x's K and weight's innermost dim
    if a.shape[1] >= GMM_INNER_LIMIT or inner >= GMM_INNER_LIMIT:
        _fail(f"npu_grouped_matmul: last dims must be below InnerLimit {GMM_INNER_LIMIT}")
    if group_list is None or group_list.dtype != torch.int64 or group_list.dim() != 1 or group_list.shape[0] != g:
        _fail(f"npu_grouped_matmul: group_list must be int64 1-D of length {g} (the weight's groups)")
    if g > GMM_MAX_GROUPS:  # doc: at most 1024 groups
        _fail(f"npu_grouped_matmul: at most {GMM_MAX_GROUPS} groups, got {g}")
    if group_list_type == 1 and g == 1:  # doc: with group_list_type 1 the length cannot be 1
        _fail("npu_grouped_matmul: with group_list_type 1 the group_list length cannot be 1")

    def per_group(name, ts, dtypes):
        # aclnn CheckOptionalTensorList: one tensor per weight tensor; a single 3-D weight's is [g, n] (the torch_npu
        # doc's "each tensor 1-D" is the multi-weight form, [n_i]; its own antiquant_scale text says [g, n])
        if ts is None or len(ts) != 1 or tuple(ts[0].shape) != (g, n):
            _fail(f"npu_grouped_matmul: {name} must be one tensor of shape ({g}, {n})")
        if ts[0].dtype not in dtypes:
            _fail(f"npu_grouped_matmul: {name} must be {' or '.join(map(str, dtypes))}, got {ts[0].dtype}")

    if a.dtype == torch.int8:
        if w.dtype != torch.int8:  # doc table 2: int8 x takes int8 weight
            _fail(f"npu_grouped_matmul: int8 x needs an int8 weight, got {w.dtype}")
        if antiquant_scale or antiquant_offset:
            _fail("npu_grouped_matmul: antiquant_scale / antiquant_offset are for float x (fake quantization)")
        if not per_token_scale:
            raise NotImplementedError("fake npu_grouped_matmul: static (per-channel) quantization is not modelled")
        per_group("scale", scale, (torch.float32, torch.bfloat16))
        # aclnn CheckPerTokenScale and doc: one float32 1-D tensor of x's m
        if len(per_token_scale) != 1 or tuple(per_token_scale[0].shape) != (a.shape[0],):
            _fail(f"npu_grouped_matmul: per_token_scale must be one 1-D tensor of length {a.shape[0]}")
        if per_token_scale[0].dtype != torch.float32:
            _fail(f"npu_grouped_matmul: per_token_scale must be float32, got {per_token_scale[0].dtype}")
        if (scale[0].dtype, output_dtype) not in GMM_PERTOKEN:  # doc table 2, per-token rows
            _fail(f"npu_grouped_matmul: per-token quantization takes (scale, output_dtype) (bfloat16, bfloat16) or "
                  f"(float32, float16), got ({scale[0].dtype}, {output_dtype})")  # fmt: skip
        return "pertoken"
    if a.dtype not in HALF or w.dtype != torch.int8:  # doc table 2, fake quantization: float16/bfloat16 x, int8 w
        _fail(f"npu_grouped_matmul: fake quantization takes float16/bfloat16 x and int8 weight, got {a.dtype}, "
              f"{w.dtype}")  # fmt: skip
    if scale or per_token_scale:  # doc table 2: not assigned in fake quantization
        _fail("npu_grouped_matmul: scale / per_token_scale are not taken in fake quantization")
    per_group("antiquant_scale", antiquant_scale, (a.dtype,))  # doc table 2: x's dtype
    per_group("antiquant_offset", antiquant_offset, (a.dtype,))  # aclnn: must not be null; x's dtype
    if output_dtype not in (None, a.dtype):  # doc table 2: None or x's dtype
        _fail(f"npu_grouped_matmul: output_dtype must be None or {a.dtype}, got {output_dtype}")
    return "antiquant"


def _counts(group_list: torch.Tensor, group_list_type: int, rows: int) -> list[int]:
    values = group_list.tolist()  # the kernel reads the list on the device; the fake on the host
    if any(v < 0 for v in values):  # doc: non-negative
        _fail(f"npu_grouped_matmul: group_list must be non-negative, got {values}")
    if group_list_type == 0:  # doc: cumsum, non-decreasing, the last value equals x's rows
        if any(b < a for a, b in zip(values, values[1:])) or values[-1] != rows:
            _fail(f"npu_grouped_matmul: cumsum group_list {values} must be non-decreasing and end at {rows}")
        return [b - a for a, b in zip([0] + values[:-1], values)]
    if sum(values) != rows:  # doc: counts summing to x's rows
        _fail(f"npu_grouped_matmul: group_list sums to {sum(values)}, x has {rows} rows")
    return values


_GMM_DEFAULTS = dict(
    bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None, per_token_scale=None,
    group_list=None, activation_input=None, activation_quant_scale=None, activation_quant_offset=None,
    split_item=0, group_type=None, group_list_type=0, act_type=0, tuning_config=None, output_dtype=None,
)  # fmt: skip
"""The schema's keyword defaults: the dispatcher passes a kernel only the keywords a caller set."""


def gmm_kernel(x, weight, **kw):
    kw = _GMM_DEFAULTS | kw
    kind = _gmm_checks(x, weight, **kw)
    (a,), (w,) = x, weight
    counts = _counts(kw["group_list"], kw["group_list_type"], a.shape[0])
    parts, start = [], 0
    for i, c in enumerate(counts):
        rows = a[start : start + c]
        if kind == "pertoken":  # (x @ w) * scale * per_token_scale, the sums exact, the scaling in fp32
            pt = kw["per_token_scale"][0][start : start + c]
            y = _int_mm(rows, w[i]).float() * kw["scale"][0][i].float() * pt.unsqueeze(-1)
            parts.append(y.to(kw["output_dtype"]))
        else:  # x @ ((w + antiquant_offset) * antiquant_scale), fp32 accumulation
            wd = _antiquant(w[i], kw["antiquant_scale"][0][i], kw["antiquant_offset"][0][i], a.dtype)
            parts.append((rows.float() @ wd.float()).to(a.dtype))
        start += c
    calls.append(("npu_grouped_matmul", kind, kw["group_list_type"], len(counts)))
    return [torch.cat(parts)]


def gmm_meta(x, weight, **kw):
    kw = _GMM_DEFAULTS | kw
    kind = _gmm_checks(x, weight, **kw)
    out = kw["output_dtype"] if kind == "pertoken" else x[0].dtype
    return [x[0].new_empty((x[0].shape[0], weight[0].shape[-1]), dtype=out)]


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                       per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
                       output_dtype=None, tuning_config=None):  # fmt: skip
    """torch_npu.npu_grouped_matmul: the quantized scenarios here, the others ops_grouped_matmul.py's (loaded first)."""
    if isinstance(group_list, (list, tuple)):
        raise NotImplementedError("fake npu_grouped_matmul: a List[int] group_list is not modelled")
    kw = dict(bias=bias, scale=scale, offset=offset, antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
              per_token_scale=per_token_scale, group_list=group_list, activation_input=activation_input,
              activation_quant_scale=activation_quant_scale, activation_quant_offset=activation_quant_offset,
              split_item=split_item, group_type=group_type, group_list_type=group_list_type, act_type=act_type,
              tuning_config=tuning_config, output_dtype=output_dtype)  # fmt: skip
    quantized = scale or per_token_scale or antiquant_scale or antiquant_offset
    if quantized or any(t.dtype == torch.int8 for t in [*x, *weight]):
        return torch.ops.fake_npu.npu_grouped_matmul_quantized(list(x), list(weight), **kw)
    return torch.ops.fake_npu.npu_grouped_matmul(list(x), list(weight), **kw)


# ---- registration, once per process (this file may load under two module names) -----------------------------------


def _registered() -> bool:
    try:
        torch.ops.fake_npu.npu_quant_matmul  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


if not _registered():
    _LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
    for _name, _kernel, _meta in (
        ("npu_dynamic_quant", _dq_kernel, _dq_meta),
        ("npu_quant_matmul", _qmm_kernel, _qmm_meta),
        ("npu_weight_quant_batchmatmul", _wq_kernel, _wq_meta),
        ("npu_grouped_matmul_quantized", gmm_kernel, gmm_meta),
    ):
        _LIB.define(SCHEMAS[_name])
        _LIB.impl(_name, _kernel, "CompositeExplicitAutograd")
        _LIB.impl(_name, _meta, "Meta")

# torch_npu binds each torch.ops.npu name as torch_npu.<name> (see ops.py): the op packets themselves.
npu_dynamic_quant = torch.ops.fake_npu.npu_dynamic_quant
npu_quant_matmul = torch.ops.fake_npu.npu_quant_matmul
npu_weight_quant_batchmatmul = torch.ops.fake_npu.npu_weight_quant_batchmatmul
