"""Device backends. `get_backend` constructs one lazily; only the chosen backend's SDK is imported."""

from __future__ import annotations

from afd.backend.base import Backend, DeviceUnavailable

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


def check_device(name: str) -> None:
    """Raises DeviceUnavailable (one line) unless `name`'s device is here: before any process starts."""
    if name == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise DeviceUnavailable(f"device cuda: no CUDA device is visible (torch {torch.__version__}: "
                                    "torch.cuda.is_available() is False)")
    elif name == "npu":
        import importlib.util

        if importlib.util.find_spec("torch_npu") is None:
            raise DeviceUnavailable("device npu: torch_npu is not installed (Ascend needs CANN and torch_npu)")
    elif name not in ("cpu", "auto"):
        raise DeviceUnavailable(f"unknown device {name!r}; expected one of {', '.join(BACKENDS)} or 'auto'")


__all__ = ["Backend", "BACKENDS", "DeviceUnavailable", "check_device", "get_backend"]
