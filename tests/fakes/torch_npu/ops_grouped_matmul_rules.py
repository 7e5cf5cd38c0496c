"""npu_grouped_matmul's documented rules for the fake op (ops_grouped_matmul.py): everything that shapes,
dtypes and arguments decide, and the value rules of a group_list. Modelled release and conventions: ops.py.
"""

from __future__ import annotations

import torch

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
