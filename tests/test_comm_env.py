"""The variables the NCCL data plane sets for its pair groups (CudaBackend.comm_env), held to the installed
torch's own ProcessGroupNCCL.hpp rather than to afd's reading of it: each is a name torch reads, and the
monitor that would terminate every process sharing a failed pair's store is off."""

from __future__ import annotations

from pathlib import Path

import torch

HEADER = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"


def test_every_nccl_variable_afd_sets_is_one_torch_reads_and_the_monitor_is_off():
    from afd.backend.cuda import CudaBackend

    env = CudaBackend.comm_env(None)  # type: ignore[arg-type]  (reads no state: no GPU needed)
    text = HEADER.read_text()
    assert [name for name in env if f'"{name}"' not in text] == []
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == env["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == env["TORCH_NCCL_BLOCKING_WAIT"] == "0"
