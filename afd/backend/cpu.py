"""The CPU backend: the reference every test runs on (gloo data plane)."""

from __future__ import annotations

import torch

from afd.backend.base import Backend, grouped_matmul_by_slices


class CpuBackend(Backend):
    name = "cpu"
    dist_backend = "gloo"

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def memory_info(self) -> tuple[int, int]:
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        return free, total

    def grouped_matmul(self, x: torch.Tensor, w: torch.Tensor, group_sizes: list[int]) -> torch.Tensor:
        # One GEMM per non-empty group over a contiguous row slice: on CPU this measures as fast as
        # torch._grouped_mm and has no alignment constraints.
        return grouped_matmul_by_slices(x, w, group_sizes)
