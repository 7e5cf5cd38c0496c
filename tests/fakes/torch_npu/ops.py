"""Fake torch_npu ops, for tests only: the real signatures, the documented constraints, plain-torch numerics.

Modelled release: Ascend Extension for PyTorch 7.1.0, i.e. op-plugin branch 7.1.0, which builds torch_npu
2.1.0 / 2.5.1 / 2.6.0 (tags v2.x.y-7.1.0). Newer docs (op-plugin 26.0.0) were read as well; where they differ
the comment says so. Product: Atlas A2 / A3 (the rules for "Atlas inference products" are not modelled).

Every rule that the documents state (in the family modules named below) raises where the real op fails:
RuntimeError with the real op's wording where its source has one (TORCH_CHECK raises RuntimeError). Paths that
this fake does not compute (quantized, List[int] group lists) raise NotImplementedError, so a test never passes
by accident on them.

The ops are torch.library operators (namespace ``fake_npu``), like torch_npu's own ``torch.ops.npu.*``:
torch.compile records them as graph nodes, their Meta kernels check what can be checked on shapes, and
their CompositeExplicitAutograd kernels compute with ordinary torch ops, so they run on CPU tensors and on
any other device's tensors. Nothing here looks at a tensor's device type.

The ops, by family: npu_grouped_matmul in ops_grouped_matmul.py (its rules in ops_grouped_matmul_rules.py),
npu_prefetch in ops_prefetch.py, npu_mm_reduce_scatter_base in ops_mm_reduce_scatter.py. Each registers its own
op once per process; this module keeps the call log they share and binds their names, as torch_npu does.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import torch

NAMESPACE = "fake_npu"

# One list per process, kept on the op namespace: this file may be loaded under two module names, and the
# kernels registered by the first load are the ones that run.
if not hasattr(torch.ops.fake_npu, "calls"):
    torch.ops.fake_npu.calls = []
calls: list[tuple] = torch.ops.fake_npu.calls
"""What the kernels did, in order: ("npu_prefetch", bytes after clamping, offset), ("npu_grouped_matmul",
group_list_type, number of groups), ... Tests read and clear it (clear(), not rebinding); torch.compile'd code
appends at run time."""

if __package__:  # torch_npu.ops: the families are modules of the package
    _PACKAGE = __package__
else:  # loaded by path (tests/fake_ops_helpers.py, tests/test_npu_mm_reduce_scatter.py) without the package,
    # whose __init__ installs the fake device: the families load as modules of a package made for them
    _PACKAGE = f"{__name__}_families"
    sys.modules.setdefault(_PACKAGE, types.ModuleType(_PACKAGE)).__path__ = [str(Path(__file__).parent)]
_gmm, _prefetch, _rs = (
    importlib.import_module(f"{_PACKAGE}.{family}")
    for family in ("ops_grouped_matmul", "ops_prefetch", "ops_mm_reduce_scatter")
)

npu_grouped_matmul = _gmm.npu_grouped_matmul
npu_prefetch = _prefetch.npu_prefetch
GRAPH_MODE_NO_DEPENDENCY = _prefetch.GRAPH_MODE_NO_DEPENDENCY
register_hcom = _rs.register_hcom
MM_REDUCE_SCATTER_SCHEMA_7_1_0 = _rs.MM_REDUCE_SCATTER_SCHEMA_7_1_0
RS_TRAINING_ONLY = _rs.RS_TRAINING_ONLY
# torch_npu's module binds each name of torch.ops.npu as torch_npu.<name> (Ascend/pytorch torch_npu/__init__.py,
# v2.6.0-7.1.0 and master), so torch_npu.npu_mm_reduce_scatter_base is the op packet itself, whose schema a caller
# can read (NpuBackend does, to find comm_mode). The fake hands out its op the same way.
npu_mm_reduce_scatter_base = _rs.npu_mm_reduce_scatter_base
