"""The fake torch_npu.npu_grouped_matmul's quantized scenarios: per-token quantization and fake quantization
(antiquant), single x, single 3-D weight, single y (the one form afd uses; the unquantized op stays in
ops_grouped_matmul.py). ops_quant.py registers the op; its docstring says what is modelled and what not.

sources (read 2026-12-02):
  doc: https://github.com/Ascend/op-plugin/blob/7.1.0/docs/context/torch_npu-npu_grouped_matmul.md (op-plugin
    7.1.0); the same name under .../blob/26.0.0/docs/en/custom_APIs/torch_npu/ (26.0.0)
  schema: op_plugin/config/op_plugin_functions.yaml @7.1.0 (npu_grouped_matmul, as ops_grouped_matmul.py's)
  aclnnGroupedMatmulV4 (the kernel npu_grouped_matmul calls): CANN ops-transformer gmm/grouped_matmul/docs/
    aclnnGroupedMatmulV4.md and op_host/op_api/aclnn_grouped_matmul.cpp (CheckOptionalTensorList: a single 3-D
    weight's scale / antiquant_scale / antiquant_offset is [g, n]; CheckPerTokenScale: per_token_scale one 1-D
    [m] tensor, x / weight / y single; CheckGroupedMatmulAntiQuant: antiquant_offset must not be null), read at
    repo-mirror-test/ops-transformer @bfbbec8
"""

from __future__ import annotations

import torch

from .ops_quant_gemm import HALF, _antiquant, _fail, _int_mm, _nd_or_transposed, calls

_GMM_ARGS = (
    "(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
    "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
    "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
    "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
    "int? group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, "
    "ScalarType? output_dtype=None) -> Tensor[]"
)
# torch_npu has one npu_grouped_matmul; the fake registers its quantized scenarios under a second name, which
# the Python entry point below routes to, so that ops_grouped_matmul.py's unquantized op stays as it is.
SCHEMA = "npu_grouped_matmul_quantized" + _GMM_ARGS
GMM_MAX_GROUPS, GMM_INNER_LIMIT = 1024, 65536  # doc npu_grouped_matmul (as ops_grouped_matmul_rules.py)
# doc npu_grouped_matmul table 2 (Tensor group_list), per-token rows: scale bfloat16 -> bfloat16, float32 -> float16
GMM_PERTOKEN = {(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)}


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
