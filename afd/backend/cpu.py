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

    def prefetch(self, weight: torch.Tensor, max_bytes: int) -> int:
        # Reads one value per 64-byte line of the first max_bytes: the lines land in the caches before the
        # GEMM needs them. Costs memory bandwidth; the suite decides whether it pays (off by default).
        flat = weight.detach().reshape(-1)
        n = min(flat.numel(), max_bytes // flat.element_size())
        if n <= 0:
            return 0
        step = max(1, 64 // flat.element_size())
        flat[:n:step].sum()
        return n * flat.element_size()

    def grouped_matmul(self, x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        # One GEMM per non-empty group over a contiguous row slice: on CPU this measures as fast as
        # torch._grouped_mm and has no alignment constraints.
        return grouped_matmul_by_slices(x, w, group_sizes)
