"""`torch_npu._C._distributed_c10d`: where torch_npu 2.x binds ProcessGroupHCCL (the fake's is hccl.py's)."""

from ..hccl import ProcessGroupHCCL  # noqa: F401
