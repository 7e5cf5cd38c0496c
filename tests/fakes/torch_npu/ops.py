"""Fake torch_npu ops, for tests only: the real signatures, the documented constraints, plain-torch numerics.

Modelled release: Ascend Extension for PyTorch 7.1.0, i.e. op-plugin branch 7.1.0, which builds torch_npu
2.1.0 / 2.5.1 / 2.6.0 (tags v2.x.y-7.1.0). Newer docs (op-plugin 26.0.0) were read as well; where they differ
the comment says so. Product: Atlas A2 / A3 (the rules for "Atlas inference products" are not modelled).

Every rule below that the documents state raises where the real op fails: RuntimeError with the real op's
wording where its source has one (TORCH_CHECK raises RuntimeError). Paths that this fake does not compute
(quantized, List[int] group lists) raise NotImplementedError, so a test never passes by accident on them.

The ops are torch.library operators (namespace ``fake_npu``), like torch_npu's own ``torch.ops.npu.*``:
torch.compile records them as graph nodes, their Meta kernels check what can be checked on shapes, and
their CompositeExplicitAutograd kernels compute with ordinary torch ops, so they run on CPU tensors and on
any other device's tensors. Nothing here looks at a tensor's device type.
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

NAMESPACE = "fake_npu"

# The schemas are torch_npu's, so that keyword names, defaults and types are checked by the dispatcher.
# source: op_plugin_functions.yaml (npu_grouped_matmul, npu_prefetch, npu_mm_reduce_scatter_base),
#   https://github.com/Ascend/op-plugin/blob/7.1.0/op_plugin/config/op_plugin_functions.yaml, op-plugin 7.1.0;
#   npu_mm_reduce_scatter_base from .../blob/26.0.0/op_plugin/config/op_plugin_functions.yaml, op-plugin 26.0.0
_SCHEMAS = {
    "npu_grouped_matmul": (
        "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
        "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
        "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
        "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
        "int? group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, "
        "ScalarType? output_dtype=None) -> Tensor[]"
    ),
    "npu_prefetch": "npu_prefetch(Tensor self, Tensor? dependency, int max_size, int offset=0) -> ()",
    # op-plugin 26.0.0 (the same from 7.2.0 on): comm_mode and the quantization arguments; 7.1.0's below.
    "npu_mm_reduce_scatter_base": (
        "npu_mm_reduce_scatter_base(Tensor self, Tensor x2, str hcom, int world_size, *, str reduce_op='sum', "
        "Tensor? bias=None, Tensor? x1_scale=None, Tensor? x2_scale=None, int comm_turn=0, "
        "ScalarType? output_dtype=None, str? comm_mode=None) -> Tensor"
    ),
}

# One list per process, kept on the op namespace: this file may be loaded under two module names, and the
# kernels registered by the first load are the ones that run.
if not hasattr(torch.ops.fake_npu, "calls"):
    torch.ops.fake_npu.calls = []
calls: list[tuple] = torch.ops.fake_npu.calls
"""What the kernels did, in order: ("npu_prefetch", bytes after clamping, offset), ("npu_grouped_matmul",
group_list_type, number of groups), ... Tests read and clear it (clear(), not rebinding); torch.compile'd code
appends at run time."""

# ---------------------------------------------------------------------------------------------------------
# npu_grouped_matmul
# source: torch_npu.npu_grouped_matmul,
#   https://github.com/Ascend/op-plugin/blob/7.1.0/docs/context/torch_npu-npu_grouped_matmul.md, op-plugin 7.1.0
# source: GroupedMatmulKernelNpuOpApi.cpp (the torch_npu side of the op),
#   https://github.com/Ascend/op-plugin/blob/7.1.0/op_plugin/ops/opapi/GroupedMatmulKernelNpuOpApi.cpp, 7.1.0
# ---------------------------------------------------------------------------------------------------------

# doc, x / weight: "列表最大长度为128" (at most 128 tensors per list); this also covers the doc's "length at
# most 128" for group_list_type 1 with a list of 2-D weights (one group per weight tensor).
_GMM_MAX_LIST = 128
_GMM_MAX_GROUPS = 1024  # doc, group_type 0 single-single-single: group_list's first dim at most 1024
_GMM_INNER_LIMIT = 65536  # doc, A2/A3: InnerLimit; the last dim of every x_i and weight_i must be below it
_GMM_FLOATS = (torch.float16, torch.bfloat16, torch.float32)  # doc, x on A2/A3, besides int8 (quantized)
# doc, table 2 (group_list a Tensor), non-quantized rows: x == weight dtype, and bias dtype per x dtype.
_GMM_BIAS_DTYPE = {torch.float16: torch.float16, torch.bfloat16: torch.float32, torch.float32: torch.float32}


def _fail(msg: str) -> None:
    raise RuntimeError(msg)


def _transposed(t: torch.Tensor) -> bool:
    """The doc's "transposed" tensor: shape [.., M, K] laid out as [.., K, M] (stride 1 on the row axis)."""
    return t.dim() >= 2 and t.stride(-1) != 1 and t.stride(-2) == 1 and t.shape[-2] > 1


def _inner_dim(t: torch.Tensor) -> int:
    # doc, InnerLimit: "the last dimension" is the one laid out innermost: N of weight_i, or K when transposed.
    return t.shape[-2] if _transposed(t) else t.shape[-1]


def _gmm_static_checks(
    x,
    weight,
    bias,
    scale,
    offset,
    antiquant_scale,
    antiquant_offset,
    per_token_scale,
    group_list,
    activation_input,
    activation_quant_scale,
    activation_quant_offset,
    split_item,
    group_type,
    group_list_type,
    act_type,
    tuning_config,
    output_dtype,
) -> str:
    """Every documented rule that shapes, dtypes and arguments decide; returns the scenario's name."""
    # source code, 7.1.0: TORCH_CHECK(group_type.has_value(), ...) before anything else.
    if group_type is None:
        _fail("Requires manual passing group_type, current is None.")
    # doc 7.1.0: A2/A3 take group_type -1 (no grouping) or 0 (M axis); source code checks the same.
    # (op-plugin 7.2.0 and later also take 2, the K axis; 7.1.0 refuses it.)
    if group_type not in (-1, 0):
        _fail(f"group_type currently only support -1 and 0, current value is {group_type}")
    if not x or not weight:
        _fail("Invalid inputs: neither x nor weight could be empty.")  # source code, check_dims
    if len(x) > _GMM_MAX_LIST or len(weight) > _GMM_MAX_LIST:
        _fail(
            f"npu_grouped_matmul: x and weight hold at most {_GMM_MAX_LIST} tensors each, got {len(x)} and "
            f"{len(weight)}"
        )
    # doc: split_item 0/1 -> one output per weight; 2/3 -> a single output tensor. source code: check_dims.
    if split_item not in (0, 1, 2, 3):
        _fail(f"Invalid value of split_item [{split_item}], which should only be one of 0/1/2/3.")
    # Quantized and fake-quantized paths (int8/int4, scales) are out of this fake's scope.
    for name, v in (
        ("scale", scale),
        ("antiquant_scale", antiquant_scale),
        ("antiquant_offset", antiquant_offset),
        ("per_token_scale", per_token_scale),
    ):
        if v:
            raise NotImplementedError(f"fake npu_grouped_matmul: {name} (quantization) is not modelled")
    # doc: offset, activation_input, activation_quant_scale, activation_quant_offset: only None is supported.
    for name, v in (
        ("offset", offset),
        ("activation_input", activation_input),
        ("activation_quant_scale", activation_quant_scale),
        ("activation_quant_offset", activation_quant_offset),
    ):
        if v:
            _fail(f"npu_grouped_matmul: {name} only supports None")
    dtype = x[0].dtype
    if dtype in (torch.int8, torch.int32) or any(w.dtype in (torch.int8, torch.int32) for w in weight):
        raise NotImplementedError("fake npu_grouped_matmul: int8/int4 (quantized) inputs are not modelled")
    if dtype not in _GMM_FLOATS or any(t.dtype != dtype for t in x):
        _fail(f"npu_grouped_matmul: x must be float16, bfloat16 or float32 (all alike), got {[t.dtype for t in x]}")
    if any(w.dtype != dtype for w in weight):  # doc, table 2: non-quantized weight dtype == x dtype
        _fail(f"npu_grouped_matmul: weight dtype must equal x dtype {dtype}, got {[w.dtype for w in weight]}")
    single_out = split_item in (2, 3)
    # doc, table 2: float32 only when x, weight and y are single tensors.
    if dtype == torch.float32 and not (len(x) == 1 and len(weight) == 1 and single_out):
        _fail("npu_grouped_matmul: float32 is supported only when x, weight and y are single tensors")
    # doc, table 2: output_dtype None or x's dtype on the non-quantized rows.
    if output_dtype is not None and output_dtype != dtype:
        _fail(f"npu_grouped_matmul: output_dtype must be None or {dtype} for non-quantized inputs, got {output_dtype}")
    # doc: act_type 0 none, 1 RELU, 2 GELU_TANH, 3 unsupported, 4 FAST_GELU, 5 SILU; activation is computed only
    # in per-token quantization, which is not this (non-quantized) path.
    if act_type not in (0, 1, 2, 4, 5):
        _fail(f"npu_grouped_matmul: act_type must be one of 0, 1, 2, 4, 5, got {act_type}")
    if act_type != 0:
        _fail("npu_grouped_matmul: activation (act_type != 0) is supported only in per-token quantization")
    # doc: tuning_config is for quantized, single-tensor single-expert cases only.
    if tuning_config:
        _fail("npu_grouped_matmul: tuning_config is supported only in quantization scenarios")
    # doc: group_list_type 0 cumsum, 1 counts, 2 [E, 2] (index, count) pairs only with int8 x and weight.
    if group_list_type not in (0, 1, 2):
        _fail(f"npu_grouped_matmul: group_list_type must be 0, 1 or 2, got {group_list_type}")
    if group_list_type == 2:
        _fail("npu_grouped_matmul: group_list_type 2 needs int8 x and weight")
    for i, t in enumerate(x):
        if _transposed(t):  # doc, every Tensor-group_list scenario: "x does not support transposition"
            _fail(f"npu_grouped_matmul: x[{i}] must not be transposed")
        if t.shape[-1] >= _GMM_INNER_LIMIT:
            _fail(f"npu_grouped_matmul: x[{i}] last dim {t.shape[-1]} must be below InnerLimit {_GMM_INNER_LIMIT}")
    for i, w in enumerate(weight):
        if _inner_dim(w) >= _GMM_INNER_LIMIT:
            _fail(
                f"npu_grouped_matmul: weight[{i}] inner dim {_inner_dim(w)} must be below InnerLimit {_GMM_INNER_LIMIT}"
            )
    if len({_transposed(w) for w in weight}) > 1:  # doc: weight transposition must be the same for all
        _fail("npu_grouped_matmul: all weight tensors must be transposed alike")
    if group_list is not None:
        # doc: group_list dtype int64; a Tensor group_list is 1-D, its length that of weight.
        if group_list.dtype != torch.int64:
            _fail(f"npu_grouped_matmul: group_list must be int64, got {group_list.dtype}")
        if group_list.dim() != 1:
            _fail(f"npu_grouped_matmul: group_list must be 1-D, got shape {tuple(group_list.shape)}")
        # doc, group_list_type 1: "non-negative sequence, and the length cannot be 1" (op-plugin 7.1.0 and
        # 26.0.0 alike). This is the rule an FFN node holding one expert runs into.
        if group_list_type == 1 and group_list.shape[0] == 1:
            _fail("npu_grouped_matmul: with group_list_type 1 the group_list length cannot be 1")

    if group_type == -1:
        # doc, group_type -1, multi-multi-multi: split_item 0/1, no group_list, 2-D weights, x 2..6-D alike.
        if single_out:
            _fail("npu_grouped_matmul: group_type -1 requires split_item 0 or 1")
        if group_list is not None:
            _fail("npu_grouped_matmul: group_type -1 takes no group_list")
        if len(x) != len(weight):  # source code, check_dims
            _fail(
                "When split_item = 0 or 1 and input group_list is None, the num of x tensors must equal the "
                f"num of weight tensors.Actual lengths: x [{len(x)}], weight [{len(weight)}]."
            )
        if any(w.dim() != 2 for w in weight):
            _fail("npu_grouped_matmul: group_type -1 needs 2-D weight tensors")
        if len({t.dim() for t in x}) != 1 or not 2 <= x[0].dim() <= 6:
            _fail("npu_grouped_matmul: group_type -1 needs x tensors of one rank between 2 and 6")
        for i, (t, w) in enumerate(zip(x, weight)):
            if t.shape[-1] != w.shape[0]:
                _fail(f"npu_grouped_matmul: x[{i}] K {t.shape[-1]} != weight[{i}] K {w.shape[0]}")
        _check_bias(bias, [w.shape[-1] for w in weight], dtype)
        return "multi-multi-multi"

    # group_type 0: the three Tensor-group_list scenarios of the doc all have a single output (split_item 2/3);
    # single-multi-multi exists only for List[int] group lists.
    if not single_out:
        _fail("npu_grouped_matmul: group_type 0 with a Tensor group_list requires split_item 2 or 3")
    if any(t.dim() != 2 for t in x):
        _fail("npu_grouped_matmul: group_type 0 needs 2-D x tensors")
    if len(x) == 1 and len(weight) == 1 and weight[0].dim() == 3:
        # doc, single-single-single: weight 3-D [G, K, N], x and y 2-D, group_list required, at most 1024 groups.
        w = weight[0]
        if group_list is None:
            _fail("npu_grouped_matmul: single-single-single needs a group_list")
        if group_list.shape[0] != w.shape[0]:
            _fail(f"npu_grouped_matmul: group_list length {group_list.shape[0]} != number of weights {w.shape[0]}")
        if w.shape[0] > _GMM_MAX_GROUPS:
            _fail(f"npu_grouped_matmul: at most {_GMM_MAX_GROUPS} groups, got {w.shape[0]}")
        if x[0].shape[1] != w.shape[1]:
            _fail(f"npu_grouped_matmul: x K {x[0].shape[1]} != weight K {w.shape[1]}")
        if bias:
            raise NotImplementedError("fake npu_grouped_matmul: bias with a 3-D weight is not modelled")
        return "single-single-single"
    if any(w.dim() != 2 for w in weight):
        _fail("npu_grouped_matmul: with several weight tensors each must be 2-D")
    if len({w.shape[-1] for w in weight}) != 1:  # doc: "the N axis of every weight must be equal"
        _fail("npu_grouped_matmul: every weight tensor must have the same N")
    if group_list is not None and group_list.shape[0] != len(weight):
        _fail(f"npu_grouped_matmul: group_list length {group_list.shape[0]} != number of weights {len(weight)}")
    _check_bias(bias, [w.shape[-1] for w in weight], dtype)
    if len(x) == 1:
        # doc, single-multi-single: group_list required.
        if group_list is None:
            _fail("npu_grouped_matmul: single-multi-single needs a group_list")
        if any(x[0].shape[1] != w.shape[0] for w in weight):
            _fail("npu_grouped_matmul: x K differs from a weight's K")
        return "single-multi-single"
    # doc, multi-multi-single: one x per weight; group_list optional.
    if len(x) != len(weight):
        _fail(
            f"npu_grouped_matmul: multi-multi-single needs as many x as weight tensors, got {len(x)} and {len(weight)}"
        )
    for i, (t, w) in enumerate(zip(x, weight)):
        if t.shape[1] != w.shape[0]:
            _fail(f"npu_grouped_matmul: x[{i}] K {t.shape[1]} != weight[{i}] K {w.shape[0]}")
    return "multi-multi-single"


def _check_bias(bias, ns: list[int], dtype: torch.dtype) -> None:
    # doc: bias list as long as weight's, each 1-D; dtype per table 2 (bf16 x takes a float32 bias).
    if not bias:
        return
    if len(bias) != len(ns):
        _fail(f"npu_grouped_matmul: bias holds {len(bias)} tensors, weight {len(ns)}")
    for i, (b, n) in enumerate(zip(bias, ns)):
        if b.dim() != 1 or b.shape[0] != n:
            _fail(f"npu_grouped_matmul: bias[{i}] must be 1-D of length {n}, got {tuple(b.shape)}")
        if b.dtype != _GMM_BIAS_DTYPE[dtype]:
            _fail(f"npu_grouped_matmul: bias for {dtype} x must be {_GMM_BIAS_DTYPE[dtype]}, got {b.dtype}")


def _group_counts(group_list: torch.Tensor, group_list_type: int, rows: int) -> list[int]:
    """Row counts per group, after the value rules of the doc (the kernel reads group_list on the device)."""
    values = group_list.tolist()
    if any(v < 0 for v in values):
        _fail(f"npu_grouped_matmul: group_list must be non-negative, got {values}")
    if group_list_type == 0:
        # doc: cumsum form, monotonically non-decreasing; its last value equals x's rows.
        if any(b < a for a, b in zip(values, values[1:])):
            _fail(f"npu_grouped_matmul: with group_list_type 0 group_list must be non-decreasing, got {values}")
        if values[-1] != rows:
            _fail(f"npu_grouped_matmul: group_list's last value {values[-1]} != x rows {rows}")
        return [b - a for a, b in zip([0] + values[:-1], values)]
    # doc: counts form; their sum equals x's rows.
    if sum(values) != rows:
        _fail(f"npu_grouped_matmul: group_list sums to {sum(values)}, x has {rows} rows")
    return values


def _mm(a: torch.Tensor, b: torch.Tensor, bias, out_dtype: torch.dtype) -> torch.Tensor:
    # The reference accumulates in float32, as the Cube unit does, and rounds once to the output dtype.
    y = a.float() @ b.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def _gmm_kernel(
    x,
    weight,
    *,
    bias=None,
    scale=None,
    offset=None,
    antiquant_scale=None,
    antiquant_offset=None,
    per_token_scale=None,
    group_list=None,
    activation_input=None,
    activation_quant_scale=None,
    activation_quant_offset=None,
    split_item=0,
    group_type=None,
    group_list_type=0,
    act_type=0,
    tuning_config=None,
    output_dtype=None,
):
    scenario = _gmm_static_checks(
        x,
        weight,
        bias,
        scale,
        offset,
        antiquant_scale,
        antiquant_offset,
        per_token_scale,
        group_list,
        activation_input,
        activation_quant_scale,
        activation_quant_offset,
        split_item,
        group_type,
        group_list_type,
        act_type,
        tuning_config,
        output_dtype,
    )
    out_dtype = output_dtype or x[0].dtype
    bias = list(bias) if bias else [None] * (weight[0].shape[0] if weight[0].dim() == 3 else len(weight))
    if scenario == "multi-multi-multi":
        calls.append(("npu_grouped_matmul", None, len(weight)))
        return [_mm(t, w, b, out_dtype) for t, w, b in zip(x, weight, bias)]
    if scenario == "multi-multi-single":
        if group_list is not None:
            counts = _group_counts(group_list, group_list_type, sum(t.shape[0] for t in x))
            if counts != [t.shape[0] for t in x]:
                _fail(f"npu_grouped_matmul: group_list {counts} does not match the rows of x")
        calls.append(("npu_grouped_matmul", group_list_type, len(weight)))
        return [torch.cat([_mm(t, w, b, out_dtype) for t, w, b in zip(x, weight, bias)])]
    ws = list(weight[0].unbind(0)) if scenario == "single-single-single" else list(weight)
    counts = _group_counts(group_list, group_list_type, x[0].shape[0])
    calls.append(("npu_grouped_matmul", group_list_type, len(ws)))
    parts = [_mm(rows, w, b, out_dtype) for rows, w, b in zip(x[0].split(counts), ws, bias)]
    return [torch.cat(parts)]


def _gmm_meta(
    x,
    weight,
    *,
    bias=None,
    scale=None,
    offset=None,
    antiquant_scale=None,
    antiquant_offset=None,
    per_token_scale=None,
    group_list=None,
    activation_input=None,
    activation_quant_scale=None,
    activation_quant_offset=None,
    split_item=0,
    group_type=None,
    group_list_type=0,
    act_type=0,
    tuning_config=None,
    output_dtype=None,
):
    scenario = _gmm_static_checks(
        x,
        weight,
        bias,
        scale,
        offset,
        antiquant_scale,
        antiquant_offset,
        per_token_scale,
        group_list,
        activation_input,
        activation_quant_scale,
        activation_quant_offset,
        split_item,
        group_type,
        group_list_type,
        act_type,
        tuning_config,
        output_dtype,
    )
    out_dtype = output_dtype or x[0].dtype
    if scenario == "multi-multi-multi":
        return [t.new_empty((*t.shape[:-1], w.shape[-1]), dtype=out_dtype) for t, w in zip(x, weight)]
    rows = sum(t.shape[0] for t in x)
    return [x[0].new_empty((rows, weight[0].shape[-1]), dtype=out_dtype)]


def npu_grouped_matmul(
    x,
    weight,
    *,
    bias=None,
    scale=None,
    offset=None,
    antiquant_scale=None,
    antiquant_offset=None,
    per_token_scale=None,
    group_list=None,
    activation_input=None,
    activation_quant_scale=None,
    activation_quant_offset=None,
    split_item=0,
    group_type=None,
    group_list_type=0,
    act_type=0,
    output_dtype=None,
    tuning_config=None,
):
    """torch_npu.npu_grouped_matmul (doc prototype of op-plugin 7.1.0, same in 26.0.0): y_i = x_i @ weight_i."""
    if isinstance(group_list, (list, tuple)):
        # The int[] overload (npu_grouped_matmul.List) has its own rules; afd passes a device tensor.
        raise NotImplementedError("fake npu_grouped_matmul: a List[int] group_list is not modelled")
    return torch.ops.fake_npu.npu_grouped_matmul(
        list(x),
        list(weight),
        bias=bias,
        scale=scale,
        offset=offset,
        antiquant_scale=antiquant_scale,
        antiquant_offset=antiquant_offset,
        per_token_scale=per_token_scale,
        group_list=group_list,
        activation_input=activation_input,
        activation_quant_scale=activation_quant_scale,
        activation_quant_offset=activation_quant_offset,
        split_item=split_item,
        group_type=group_type,
        group_list_type=group_list_type,
        act_type=act_type,
        tuning_config=tuning_config,
        output_dtype=output_dtype,
    )


# ---------------------------------------------------------------------------------------------------------
# npu_prefetch
# source: torch_npu.npu_prefetch, https://github.com/Ascend/op-plugin/blob/7.1.0/docs/context/torch_npu-npu_prefetch.md,
#   op-plugin 7.1.0
# source: PrefetchKernelNpuOpApi.cpp (eager kernel),
#   https://github.com/Ascend/op-plugin/blob/7.1.0/op_plugin/ops/opapi/PrefetchKernelNpuOpApi.cpp, 7.1.0
# source: _meta_registrations.py (npu_prefetch_meta; has_side_effect),
#   https://github.com/Ascend/op-plugin/blob/7.1.0/op_plugin/python/meta/_meta_registrations.py, 7.1.0
# source: torchair GE converter for npu_prefetch, https://github.com/Ascend/torchair/blob/7.1.0/python/torchair/
#   _ge_concrete_graph/ge_converter/custom/npu_prefetch.py, torchair 7.1.0
# ---------------------------------------------------------------------------------------------------------

GRAPH_MODE_NO_DEPENDENCY = "torch.ops.npu.npu_prefetch.default ge converter is not implement when dependency is None."
"""The real refusal's wording (torchair 7.1.0 converter, raised while the graph is compiled)."""


def _prefetch_arg_checks(max_size: int, offset: int) -> None:
    # doc: max_size > 0; offset >= 0. Kernel and meta check both (the meta while a graph is traced).
    if max_size <= 0:
        _fail(f"max_size should be greater than zero, but got {max_size}")
    if offset < 0:
        _fail(f"offset should not be smaller than zero, but got {offset}")


def _prefetch_kernel(self: torch.Tensor, dependency, max_size: int, offset: int = 0) -> None:
    _prefetch_arg_checks(max_size, offset)
    # kernel: the offset must lie inside the tensor (so an empty tensor is refused: the doc's "no null
    # pointer"); max_size past the end is clamped to the rest of the tensor, not refused. `dependency` is
    # ignored in single-op mode (doc: "单算子下不生效可为None").
    size = self.numel() * self.element_size()
    if not size > offset:
        _fail(f"offset out of range of tensor size, tensor size: {size}, offset: {offset}")
    calls.append(("npu_prefetch", min(max_size, size - offset), offset))


def _prefetch_meta(self: torch.Tensor, dependency, max_size: int, offset: int = 0) -> None:
    _prefetch_arg_checks(max_size, offset)
    # doc: "图模式下不可为None" (in graph mode dependency must not be None); torchair's converter raises
    # NotImplementedError at compile time. Meta kernels run while torch.compile traces, which is when
    # torch.compiler.is_compiling() is true; raising RuntimeError here fails the compile (an exception class
    # that dynamo does not turn into a silent graph break and an eager rerun).
    if dependency is None and torch.compiler.is_compiling():
        _fail(GRAPH_MODE_NO_DEPENDENCY)


def npu_prefetch(input, dependency, max_size, offset=0):
    """torch_npu.npu_prefetch(input, dependency, max_size, offset=0) -> None: an L2 hint, no numerical effect."""
    torch.ops.fake_npu.npu_prefetch(input, dependency, max_size, offset)


# ---------------------------------------------------------------------------------------------------------
# npu_mm_reduce_scatter_base (attention-side tensor parallelism: NpuBackend.mm_reduce_scatter)
# This op is modelled at op-plugin 26.0.0 (the signature is the same from 7.2.0 on), not 7.1.0: 7.1.0's op has
# no comm_mode and is documented for training only ("该接口仅在训练场景下使用"), so an inference server cannot
# use it; 7.2.0 added comm_mode, and comm_mode='aiv' is the mode documented for inference as well.
# source: torch_npu.npu_mm_reduce_scatter_base, https://github.com/Ascend/op-plugin/blob/7.1.0/docs/context/
#   torch_npu-npu_mm_reduce_scatter_base.md (7.1.0); .../blob/7.2.0/docs/context/torch_npu-npu_mm_reduce_scatter_base.md
#   (7.2.0); .../blob/26.0.0/docs/en/custom_APIs/torch_npu/torch_npu-npu_mm_reduce_scatter_base.md (26.0.0)
# source: MatmulReduceScatterBaseKernelNpuOpApi.cpp (the TORCH_CHECKs, and comm_mode None -> "ai_cpu"),
#   https://github.com/Ascend/op-plugin/blob/26.0.0/op_plugin/ops/opapi/MatmulReduceScatterBaseKernelNpuOpApi.cpp
# source: aclnnMatmulReduceScatterV2 (the kernel comm_mode 'aiv' runs), CANN ops-transformer
#   mc2/matmul_reduce_scatter_v2/docs/aclnnMatmulReduceScatterV2.md (read at repo-mirror-test/ops-transformer
#   @f33d3ce); aclnnMatmulReduceScatter (the 'ai_cpu' kernel), mc2/matmul_reduce_scatter/docs/, same repository.
# ---------------------------------------------------------------------------------------------------------

MM_REDUCE_SCATTER_SCHEMA_7_1_0 = (
    "npu_mm_reduce_scatter_base(Tensor self, Tensor x2, str hcom, int world_size, *, str reduce_op='sum', "
    "Tensor? bias=None, int comm_turn=0) -> Tensor"
)
"""op-plugin 7.1.0's schema (op_plugin_functions.yaml @7.1.0): no comm_mode. Tests build a 7.1.0 op from it."""

# The communicators get_hccl_comm_name named (hccl.py), kept on the op namespace like `calls`.
if not hasattr(torch.ops.fake_npu, "hcoms"):
    torch.ops.fake_npu.hcoms = {}
_HCOMS: dict[str, object] = torch.ops.fake_npu.hcoms
# source code, all versions: TORCH_CHECK(world_size == 2 || 4 || 8 || 16 || 32) (16 and 32 are A3's).
_RS_WORLD_SIZES = (2, 4, 8, 16, 32)
_RS_AIV_WORLD_SIZES = (2, 4, 8)  # aclnnMatmulReduceScatterV2 doc, A2/A3: "支持2、4、8卡"
_RS_K_RANGE = (256, 65535)  # doc: k in [256, 65535)
_RS_COMM_MODES = ("ai_cpu", "aiv")  # doc 7.2.0+: two modes; None means "ai_cpu" (source code: value_or)
RS_TRAINING_ONLY = (
    "npu_mm_reduce_scatter_base: comm_mode 'ai_cpu' (the default) is documented for training only "
    "(\"该接口仅在训练场景下使用\"); inference needs comm_mode='aiv'"
)
"""The refusal of a call without comm_mode='aiv'. The real op does not check what it is used for; this fake
stands for afd, an inference server, so it holds afd to the documented use."""


def register_hcom(name: str, group) -> None:
    """What get_hccl_comm_name does for the fake op: `name` now reduces over `group`, any object with
    allreduce([t]) -> work, size() and rank() (a gloo process group, or a torch.distributed group)."""
    _HCOMS[name] = group


def _plain_transpose(t: torch.Tensor) -> bool:
    # doc: x2 may be passed transposed: a (k, n) view of a row-major (n, k) tensor, as weight.t() is.
    return t.dim() == 2 and t.stride() == (1, t.shape[0])


def _rs_checks(self, x2, world_size, reduce_op, bias, x1_scale, x2_scale, comm_turn, output_dtype, comm_mode):
    if x1_scale is not None or x2_scale is not None or output_dtype is not None:
        raise NotImplementedError("fake npu_mm_reduce_scatter_base: the quantized scenario is not modelled")
    # source code: the world_size and 2-D checks come first, with these words.
    if world_size not in _RS_WORLD_SIZES:
        _fail(f"world_size should be in [2, 4, 8, 16, 32], but the actual value is {world_size}.")
    if self.dim() != 2 or x2.dim() != 2:
        _fail(f"Both inputs of mm are required to be 2D, but the actual inputs are {self.dim()}D and {x2.dim()}D.")
    k = self.shape[1]
    if x2.shape[0] != k:  # source code: k of x1 == k of x2 (x2 is (k, n); nn.Linear's (n, k) weight needs .t())
        _fail(
            f"The K-axis in the two inputs of Matmul must be equal, but in reality, the K-axis of x1 is {k} and "
            f"the K-axis of x2 is {x2.shape[0]}."
        )
    if self.shape[0] % world_size:  # source code
        _fail("The M-axis in input of Matmul should be be divisible by world_size.")
    mode = "ai_cpu" if comm_mode is None else comm_mode
    if mode not in _RS_COMM_MODES:
        _fail(f"npu_mm_reduce_scatter_base: comm_mode must be 'ai_cpu' or 'aiv', got {comm_mode!r}")
    if mode != "aiv":
        _fail(RS_TRAINING_ONLY)
    if world_size not in _RS_AIV_WORLD_SIZES:
        _fail(f"npu_mm_reduce_scatter_base: comm_mode 'aiv' takes world_size 2, 4 or 8, got {world_size}")
    if self.dtype not in (torch.float16, torch.bfloat16):  # doc: float16 / bfloat16 (int8 only quantized)
        _fail(f"npu_mm_reduce_scatter_base: input must be float16 or bfloat16, got {self.dtype}")
    if x2.dtype != self.dtype:  # doc: x2 dtype as input
        _fail(f"npu_mm_reduce_scatter_base: x2 dtype {x2.dtype} != input dtype {self.dtype}")
    # doc: input may not be transposed; aclnnMatmulReduceScatter doc: x1 takes no non-contiguous tensor.
    if not self.is_contiguous():
        _fail("npu_mm_reduce_scatter_base: input must not be transposed (a contiguous ND tensor)")
    if not (x2.is_contiguous() or _plain_transpose(x2)):
        _fail("npu_mm_reduce_scatter_base: x2 must be contiguous (k, n) or the transpose of a contiguous (n, k)")
    if not _RS_K_RANGE[0] <= k < _RS_K_RANGE[1]:
        _fail(f"npu_mm_reduce_scatter_base: k must be in [{_RS_K_RANGE[0]}, {_RS_K_RANGE[1]}), got {k}")
    if self.shape[0] == 0 or x2.shape[1] == 0:  # aclnnMatmulReduceScatterV2 doc: "不支持空tensor"
        _fail("npu_mm_reduce_scatter_base: comm_mode 'aiv' takes no empty tensor")
    if reduce_op != "sum":  # doc: only 'sum'
        _fail(f"npu_mm_reduce_scatter_base: reduce_op supports only 'sum', got {reduce_op!r}")
    if bias is not None:  # aclnnMatmulReduceScatterV2 doc: with 'aiv', bias only nullptr
        _fail("npu_mm_reduce_scatter_base: bias is not supported with comm_mode 'aiv'")
    if comm_turn != 0:  # doc: only 0
        _fail(f"npu_mm_reduce_scatter_base: comm_turn supports only 0, got {comm_turn}")


def _rs_kernel(
    self,
    x2,
    hcom,
    world_size,
    *,
    reduce_op="sum",
    bias=None,
    x1_scale=None,
    x2_scale=None,
    comm_turn=0,
    output_dtype=None,
    comm_mode=None,
):
    _rs_checks(self, x2, world_size, reduce_op, bias, x1_scale, x2_scale, comm_turn, output_dtype, comm_mode)
    group = _HCOMS.get(hcom)
    if group is None:  # doc: hcom is the name get_hccl_comm_name returned
        _fail(f"npu_mm_reduce_scatter_base: unknown hcom {hcom!r} (not a name get_hccl_comm_name returned)")
    if group.size() != world_size:  # doc: world_size is the number of ranks of the communicator
        _fail(f"npu_mm_reduce_scatter_base: world_size {world_size} != size {group.size()} of {hcom!r}")
    full = self.float() @ x2.float()  # the Cube unit accumulates in float32
    group.allreduce([full]).wait()  # a sum over ranks, then this rank's row block: a reduce-scatter
    rows = self.shape[0] // world_size
    rank = group.rank()
    calls.append(("npu_mm_reduce_scatter_base", hcom, world_size))
    return full[rank * rows : (rank + 1) * rows].to(self.dtype).contiguous()


def _rs_meta(
    self,
    x2,
    hcom,
    world_size,
    *,
    reduce_op="sum",
    bias=None,
    x1_scale=None,
    x2_scale=None,
    comm_turn=0,
    output_dtype=None,
    comm_mode=None,
):
    _rs_checks(self, x2, world_size, reduce_op, bias, x1_scale, x2_scale, comm_turn, output_dtype, comm_mode)
    return self.new_empty((self.shape[0] // world_size, x2.shape[1]))


# ---------------------------------------------------------------------------------------------------------
# Registration, once per process: loading this file twice (two import paths) must not define the ops twice.
# The Library object stays alive through the kernels' __globals__, which the dispatcher keeps.
# ---------------------------------------------------------------------------------------------------------


def _registered() -> bool:
    try:
        torch.ops.fake_npu.npu_prefetch  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


if not _registered():
    _LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
    for _name, _kernel, _meta in (
        ("npu_grouped_matmul", _gmm_kernel, _gmm_meta),
        ("npu_prefetch", _prefetch_kernel, _prefetch_meta),
        ("npu_mm_reduce_scatter_base", _rs_kernel, _rs_meta),
    ):
        _LIB.define(_SCHEMAS[_name])
        _LIB.impl(_name, _kernel, "CompositeExplicitAutograd")
        _LIB.impl(_name, _meta, "Meta")
    # torch_npu marks npu_prefetch side-effecting, so that dead-code elimination keeps the output-less node.
    has_side_effect(torch.ops.fake_npu.npu_prefetch.default)

# torch_npu's module binds each name of torch.ops.npu as torch_npu.<name> (Ascend/pytorch torch_npu/__init__.py,
# v2.6.0-7.1.0 and master), so torch_npu.npu_mm_reduce_scatter_base is the op packet itself, whose schema a caller
# can read (NpuBackend does, to find comm_mode). The fake hands out its op the same way.
npu_mm_reduce_scatter_base = torch.ops.fake_npu.npu_mm_reduce_scatter_base
