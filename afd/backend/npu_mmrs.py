"""The documented limits of torch_npu.npu_mm_reduce_scatter_base, the fused matmul + ReduceScatter NpuBackend.
mm_reduce_scatter calls (row-parallel layers under a sharded TP mode)."""

from __future__ import annotations

import torch

# source: torch_npu.npu_mm_reduce_scatter_base ("doc" below), https://github.com/Ascend/op-plugin/blob/7.1.0/docs/
#   context/torch_npu-npu_mm_reduce_scatter_base.md (op-plugin 7.1.0), the same path @7.2.0 (7.2.0, comm_mode
#   added), and .../blob/26.0.0/docs/en/custom_APIs/torch_npu/torch_npu-npu_mm_reduce_scatter_base.md (26.0.0).
# source: the kernel comm_mode "aiv" runs ("V2 doc"), aclnnMatmulReduceScatterV2, CANN ops-transformer
#   mc2/matmul_reduce_scatter_v2/docs/aclnnMatmulReduceScatterV2.md (read at repo-mirror-test/ops-transformer
#   @f33d3ce). Both list Atlas A2 and A3 only: Ascend 950 takes "ccu" or "ai_cpu", not "aiv" (vllm-ascend #12689),
#   and is not handled here.
MMRS_DTYPES = (torch.float16, torch.bfloat16)
"""input and x2, one dtype (doc, all versions; int8 only in the quantized scenario afd does not use)."""
MMRS_WORLD_SIZES = (2, 4, 8)
"""Atlas A2 takes 2/4/8 ranks, A3 also 16/32 (doc); the "aiv" kernel only 2/4/8 (aclnnMatmulReduceScatterV2
doc), which is also vllm-ascend's mmrs_fusion default, tp <= 8
(docs/design/tp-communication.md#thresholds)."""
MMRS_K_RANGE = (256, 65535)
"""k in [256, 65535) (doc, all versions)."""
MMRS_COMM_MODE = "aiv"
"""7.1.0's op (no comm_mode) and comm_mode "ai_cpu", the default since 7.2.0, are documented "仅在训练场景下使用"
(training only); "aiv" is documented for training and inference (doc 7.2.0, 26.0.0). vllm-ascend passes "aiv"
on A2/A3 too (vllm_ascend/device/device_op.py, BaseDeviceAdaptor.npu_mm_reduce_scatter_base)."""


def takes_argument(op, name: str) -> bool:
    # torch_npu.<op> is the torch.ops.npu packet (torch_npu/__init__.py binds each name of torch.ops.npu), so
    # its schema says which release's signature this is.
    schema = getattr(getattr(op, "default", None), "_schema", None)
    return schema is not None and any(a.name == name for a in schema.arguments)


def mmrs_fits(x: torch.Tensor, weight: torch.Tensor, world_size: int) -> bool:
    """Whether npu_mm_reduce_scatter_base is documented to take x [m, k] @ weight[n, k]^T over world_size
    ranks; outside, the caller's matmul and reduce_scatter run instead."""
    if x.dim() != 2 or weight.dim() != 2:  # doc: input and x2 are 2-D
        return False
    if x.dtype not in MMRS_DTYPES or weight.dtype != x.dtype:  # doc: float16 / bfloat16, x2 as input
        return False
    if world_size not in MMRS_WORLD_SIZES:
        return False
    (m, k), (n, k_w) = x.shape, weight.shape
    if k_w != k or not MMRS_K_RANGE[0] <= k < MMRS_K_RANGE[1]:  # doc: equal k, in [256, 65535)
        return False
    if m == 0 or n == 0 or m % world_size:  # V2 doc: no empty tensor; doc: m divisible by world_size
        return False
    # doc: x2 may be transposed; weight.t() of a row-major weight is that plain transpose, other strides are not
    # documented.
    return weight.is_contiguous()
