"""The CUDA backend: NCCL data plane on a dedicated stream, torch._grouped_mm for experts."""

from __future__ import annotations

import torch

from afd.backend.base import Backend, DeviceUnavailable, grouped_matmul_by_slices


class CudaBackend(Backend):
    name = "cuda"
    dist_backend = "nccl"

    def __init__(self, index: int = 0):
        if not torch.cuda.is_available():
            raise DeviceUnavailable(f"device cuda: no CUDA device is visible (torch {torch.__version__}: "
                                    "torch.cuda.is_available() is False)")
        self._device = torch.device("cuda", index)
        torch.cuda.set_device(self._device)
        self._comm = torch.cuda.Stream(device=self._device)

    @property
    def device(self) -> torch.device:
        return self._device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self._device)

    def comm_stream(self):
        return self._comm

    def stream_scope(self, stream):
        return torch.cuda.stream(stream)

    def record_event(self):
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def wait_event(self, event, stream=None) -> None:
        (stream or torch.cuda.current_stream()).wait_event(event)

    def memory_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self._device)

    # prefetch stays the base no-op: a GEMM on a GPU already streams its weights from HBM at full
    # bandwidth, and the real L2 tool (a cudaAccessPolicyWindow persisting region) is not reachable
    # from torch without the CUDA runtime API. Reasoned, not measured: see docs/benchmarks.md.

    def grouped_matmul(self, x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        aligned = x.dtype in (torch.bfloat16,) and x.shape[1] % 8 == 0 and w.shape[-1] % 8 == 0
        if aligned and hasattr(torch, "_grouped_mm"):
            offs = group_sizes.cumsum(0, dtype=torch.int32)  # end row of each group
            return torch._grouped_mm(x, w, offs=offs)
        return grouped_matmul_by_slices(x, w, group_sizes)
