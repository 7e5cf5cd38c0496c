"""Device backends. `get_backend` constructs one lazily; only the chosen backend's SDK is imported."""

from __future__ import annotations

from afd.backend.base import Backend

BACKENDS = ("cpu", "cuda", "npu")


def get_backend(name: str = "cpu", index: int = 0) -> Backend:
    if name == "auto":
        import torch

        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        from afd.backend.cpu import CpuBackend

        return CpuBackend()
    if name == "cuda":
        from afd.backend.cuda import CudaBackend

        return CudaBackend(index)
    if name == "npu":
        from afd.backend.npu import NpuBackend

        return NpuBackend(index)
    raise ValueError(f"unknown device {name!r}; expected one of {', '.join(BACKENDS)} or 'auto'")


__all__ = ["Backend", "BACKENDS", "get_backend"]
