"""Fake torch_npu.npu_mm_reduce_scatter_base (attention-side tensor parallelism: NpuBackend.mm_reduce_scatter):
a matmul whose float32 result is summed over the communicator's ranks and scattered by rows, after the documented
rules (the sources below), on the communicators get_hccl_comm_name named (hccl.py). Modelled release and
conventions: ops.py (this op at op-plugin 26.0.0, as said below).
"""

from __future__ import annotations

import torch

from .oplib import register_once

NAMESPACE = "fake_npu"

# The schema is torch_npu's, so that keyword names, defaults and types are checked by the dispatcher: argument
# names as torch_npu 2.14.0's library registers them (tests/test_vendor_npu.py; the yaml below says `self`).
# source: op_plugin_functions.yaml,
#   https://github.com/Ascend/op-plugin/blob/26.0.0/op_plugin/config/op_plugin_functions.yaml, op-plugin 26.0.0
# (the same from 7.2.0 on): comm_mode and the quantization arguments; 7.1.0's below.
SCHEMA = (
    "npu_mm_reduce_scatter_base(Tensor input, Tensor x2, str hcom, int world_size, *, str reduce_op='sum', "
    "Tensor? bias=None, Tensor? x1_scale=None, Tensor? x2_scale=None, int comm_turn=0, "
    "ScalarType? output_dtype=None, str? comm_mode=None) -> Tensor"
)

# The call log ops.py keeps on the op namespace (this file too may be loaded on its own, under another name).
if not hasattr(torch.ops.fake_npu, "calls"):
    torch.ops.fake_npu.calls = []
calls: list[tuple] = torch.ops.fake_npu.calls


def _fail(msg: str) -> None:
    raise RuntimeError(msg)  # TORCH_CHECK's exception, as ops.py


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
    "npu_mm_reduce_scatter_base(Tensor input, Tensor x2, str hcom, int world_size, *, str reduce_op='sum', "
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


def _rs_checks(input, x2, world_size, reduce_op, bias, x1_scale, x2_scale, comm_turn, output_dtype, comm_mode):
    if x1_scale is not None or x2_scale is not None or output_dtype is not None:
        raise NotImplementedError("fake npu_mm_reduce_scatter_base: the quantized scenario is not modelled")
    # source code: the world_size and 2-D checks come first, with these words.
    if world_size not in _RS_WORLD_SIZES:
        _fail(f"world_size should be in [2, 4, 8, 16, 32], but the actual value is {world_size}.")
    if input.dim() != 2 or x2.dim() != 2:
        _fail(f"Both inputs of mm are required to be 2D, but the actual inputs are {input.dim()}D and {x2.dim()}D.")
    k = input.shape[1]
    if x2.shape[0] != k:  # source code: k of x1 == k of x2 (x2 is (k, n); nn.Linear's (n, k) weight needs .t())
        _fail(
            f"The K-axis in the two inputs of Matmul must be equal, but in reality, the K-axis of x1 is {k} and "
            f"the K-axis of x2 is {x2.shape[0]}."
        )
    if input.shape[0] % world_size:  # source code
        _fail("The M-axis in input of Matmul should be be divisible by world_size.")
    mode = "ai_cpu" if comm_mode is None else comm_mode
    if mode not in _RS_COMM_MODES:
        _fail(f"npu_mm_reduce_scatter_base: comm_mode must be 'ai_cpu' or 'aiv', got {comm_mode!r}")
    if mode != "aiv":
        _fail(RS_TRAINING_ONLY)
    if world_size not in _RS_AIV_WORLD_SIZES:
        _fail(f"npu_mm_reduce_scatter_base: comm_mode 'aiv' takes world_size 2, 4 or 8, got {world_size}")
    if input.dtype not in (torch.float16, torch.bfloat16):  # doc: float16 / bfloat16 (int8 only quantized)
        _fail(f"npu_mm_reduce_scatter_base: input must be float16 or bfloat16, got {input.dtype}")
    if x2.dtype != input.dtype:  # doc: x2 dtype as input
        _fail(f"npu_mm_reduce_scatter_base: x2 dtype {x2.dtype} != input dtype {input.dtype}")
    # doc: input may not be transposed; aclnnMatmulReduceScatter doc: x1 takes no non-contiguous tensor.
    if not input.is_contiguous():
        _fail("npu_mm_reduce_scatter_base: input must not be transposed (a contiguous ND tensor)")
    if not (x2.is_contiguous() or _plain_transpose(x2)):
        _fail("npu_mm_reduce_scatter_base: x2 must be contiguous (k, n) or the transpose of a contiguous (n, k)")
    if not _RS_K_RANGE[0] <= k < _RS_K_RANGE[1]:
        _fail(f"npu_mm_reduce_scatter_base: k must be in [{_RS_K_RANGE[0]}, {_RS_K_RANGE[1]}), got {k}")
    if input.shape[0] == 0 or x2.shape[1] == 0:  # aclnnMatmulReduceScatterV2 doc: "不支持空tensor"
        _fail("npu_mm_reduce_scatter_base: comm_mode 'aiv' takes no empty tensor")
    if reduce_op != "sum":  # doc: only 'sum'
        _fail(f"npu_mm_reduce_scatter_base: reduce_op supports only 'sum', got {reduce_op!r}")
    if bias is not None:  # aclnnMatmulReduceScatterV2 doc: with 'aiv', bias only nullptr
        _fail("npu_mm_reduce_scatter_base: bias is not supported with comm_mode 'aiv'")
    if comm_turn != 0:  # doc: only 0
        _fail(f"npu_mm_reduce_scatter_base: comm_turn supports only 0, got {comm_turn}")


def _rs_kernel(
    input,
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
    _rs_checks(input, x2, world_size, reduce_op, bias, x1_scale, x2_scale, comm_turn, output_dtype, comm_mode)
    group = _HCOMS.get(hcom)
    if group is None:  # doc: hcom is the name get_hccl_comm_name returned
        _fail(f"npu_mm_reduce_scatter_base: unknown hcom {hcom!r} (not a name get_hccl_comm_name returned)")
    if group.size() != world_size:  # doc: world_size is the number of ranks of the communicator
        _fail(f"npu_mm_reduce_scatter_base: world_size {world_size} != size {group.size()} of {hcom!r}")
    full = input.float() @ x2.float()  # the Cube unit accumulates in float32
    group.allreduce([full]).wait()  # a sum over ranks, then this rank's row block: a reduce-scatter
    rows = input.shape[0] // world_size
    rank = group.rank()
    calls.append(("npu_mm_reduce_scatter_base", hcom, world_size))
    return full[rank * rows : (rank + 1) * rows].to(input.dtype).contiguous()


def _rs_meta(
    input,
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
    _rs_checks(input, x2, world_size, reduce_op, bias, x1_scale, x2_scale, comm_turn, output_dtype, comm_mode)
    return input.new_empty((input.shape[0] // world_size, x2.shape[1]))


register_once("npu_mm_reduce_scatter_base", SCHEMA, _rs_kernel, _rs_meta)  # once per process, as ops.py

# torch_npu.<op> is the op packet (ops.py says why)
npu_mm_reduce_scatter_base = torch.ops.fake_npu.npu_mm_reduce_scatter_base
