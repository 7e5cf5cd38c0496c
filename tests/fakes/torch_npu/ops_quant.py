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

The ops live in ops_quant_gemm.py (the 2-D ones) and ops_quant_gmm.py (npu_grouped_matmul's quantized scenarios);
this module registers them and binds their names, as torch_npu does.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import torch

NAMESPACE = "fake_npu"
if __package__:  # torch_npu.ops_quant: the parts are modules of the package
    _PACKAGE = __package__
else:  # loaded by path (tests/test_npu_quant.py) without the package: the parts load as modules of a package
    # made for them, as ops.py's families do
    _PACKAGE = f"{__name__}_parts"
    sys.modules.setdefault(_PACKAGE, types.ModuleType(_PACKAGE)).__path__ = [str(Path(__file__).parent)]
_oplib, _gemm, _gmm = (
    importlib.import_module(f"{_PACKAGE}.{part}") for part in ("oplib", "ops_quant_gemm", "ops_quant_gmm")
)

calls = _gemm.calls
SCHEMAS = _gemm.SCHEMAS | {"npu_grouped_matmul_quantized": _gmm.SCHEMA}
gmm_kernel, gmm_meta, npu_grouped_matmul = _gmm.gmm_kernel, _gmm.gmm_meta, _gmm.npu_grouped_matmul

# once per process (this file may load under two module names)
for _name, _kernel, _meta in (
    ("npu_dynamic_quant", _gemm._dq_kernel, _gemm._dq_meta),
    ("npu_quant_matmul", _gemm._qmm_kernel, _gemm._qmm_meta),
    ("npu_weight_quant_batchmatmul", _gemm._wq_kernel, _gemm._wq_meta),
    ("npu_grouped_matmul_quantized", gmm_kernel, gmm_meta),
):
    _oplib.register_once(_name, SCHEMAS[_name], _kernel, _meta)

# torch_npu binds each torch.ops.npu name as torch_npu.<name> (see ops.py): the op packets themselves.
npu_dynamic_quant = torch.ops.fake_npu.npu_dynamic_quant
npu_quant_matmul = torch.ops.fake_npu.npu_quant_matmul
npu_weight_quant_batchmatmul = torch.ops.fake_npu.npu_weight_quant_batchmatmul
