"""Fake torch_npu.npu_prefetch: an L2 prefetch hint with no numerical effect, its argument rules, and graph
mode's refusal of a prefetch without a dependency (the sources below). Modelled release and conventions: ops.py.
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

from .oplib import register_once

NAMESPACE = "fake_npu"

# The schema is torch_npu's, so that keyword names, defaults and types are checked by the dispatcher.
# source: op_plugin_functions.yaml,
#   https://github.com/Ascend/op-plugin/blob/7.1.0/op_plugin/config/op_plugin_functions.yaml, op-plugin 7.1.0
SCHEMA = "npu_prefetch(Tensor self, Tensor? dependency, int max_size, int offset=0) -> ()"

# The call log ops.py keeps on the op namespace (this file too may be loaded on its own, under another name).
if not hasattr(torch.ops.fake_npu, "calls"):
    torch.ops.fake_npu.calls = []
calls: list[tuple] = torch.ops.fake_npu.calls


def _fail(msg: str) -> None:
    raise RuntimeError(msg)  # TORCH_CHECK's exception, as ops.py


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


if register_once("npu_prefetch", SCHEMA, _prefetch_kernel, _prefetch_meta):  # once per process, as ops.py
    # torch_npu marks npu_prefetch side-effecting, so that dead-code elimination keeps the output-less node.
    has_side_effect(torch.ops.fake_npu.npu_prefetch.default)
