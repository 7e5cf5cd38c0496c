"""Fake torch_npu.npu_grouped_matmul, unquantized (the quantized scenarios: ops_quant.py): y_i = x_i @ weight_i,
computed in float32 as the Cube unit accumulates, after the documented rules (ops_grouped_matmul_rules.py, with
the documents they come from). Modelled release and conventions: ops.py.

source: torch_npu.npu_grouped_matmul,
  https://github.com/Ascend/op-plugin/blob/7.1.0/docs/context/torch_npu-npu_grouped_matmul.md, op-plugin 7.1.0
"""

from __future__ import annotations

import torch

from .oplib import register_once
from .ops_grouped_matmul_rules import _fail, _gmm_static_checks, _group_counts

NAMESPACE = "fake_npu"

# The schema is torch_npu's, so that keyword names, defaults and types are checked by the dispatcher.
# source: op_plugin_functions.yaml,
#   https://github.com/Ascend/op-plugin/blob/7.1.0/op_plugin/config/op_plugin_functions.yaml, op-plugin 7.1.0
SCHEMA = (
    "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
    "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
    "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
    "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
    "int? group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, "
    "ScalarType? output_dtype=None) -> Tensor[]"
)

# The call log ops.py keeps on the op namespace (this file too may be loaded on its own, under another name).
if not hasattr(torch.ops.fake_npu, "calls"):
    torch.ops.fake_npu.calls = []
calls: list[tuple] = torch.ops.fake_npu.calls


def _mm(a: torch.Tensor, b: torch.Tensor, bias, out_dtype: torch.dtype) -> torch.Tensor:
    # The reference accumulates in float32, as the Cube unit does, and rounds once to the output dtype.
    y = a.float() @ b.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def _gmm_kernel(x, weight, **kw):
    """The schema's keyword arguments (SCHEMA: the dispatcher has checked their names and types) as `kw`."""
    scenario = _gmm_static_checks(x, weight, **kw)
    bias, group_list, group_list_type = kw.get("bias"), kw.get("group_list"), kw.get("group_list_type", 0)
    out_dtype = kw.get("output_dtype") or x[0].dtype
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


def _gmm_meta(x, weight, **kw):
    scenario = _gmm_static_checks(x, weight, **kw)
    out_dtype = kw.get("output_dtype") or x[0].dtype
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


register_once("npu_grouped_matmul", SCHEMA, _gmm_kernel, _gmm_meta)  # once per process, as ops.py
