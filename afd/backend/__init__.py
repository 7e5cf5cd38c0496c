"""Device backends. `get_backend` constructs one lazily; only the chosen backend's SDK is imported."""

from __future__ import annotations

import logging

from afd.backend.base import Backend, DeviceUnavailable

BACKENDS = ("cpu", "cuda", "npu")

log = logging.getLogger("afd.backend")


def resolve_device(name: str) -> str:
    """`auto` as the device it means here: npu when torch_npu imports and sees an NPU, else cuda when
    torch sees a GPU, else cpu. Any other name is returned as it is. The one place `auto` is decided."""
    if name != "auto":
        return name
    if _npu_available():
        return "npu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _npu_available() -> bool:
    """torch_npu is imported here, on demand only: importing afd never imports a device SDK."""
    try:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception as e:
        if isinstance(e, ModuleNotFoundError) and e.name == "torch_npu":
            return False  # not installed
        # installed but broken (a missing dependency, CANN's environment not set): say why, then skip it
        log.warning(
            "device auto: torch_npu is installed but does not import (%s: %s); not using npu", type(e).__name__, e
        )
        return False
    npu = getattr(torch, "npu", None)
    try:
        return npu is not None and bool(npu.is_available())
    except Exception as e:  # a driver error is "no NPU here" for auto
        log.warning("device auto: torch.npu.is_available() failed (%s: %s); not using npu", type(e).__name__, e)
        return False


def get_backend(name: str = "cpu", index: int = 0) -> Backend:
    name = resolve_device(name)
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
    """Raises DeviceUnavailable (one line) unless `name`'s device is here: before any process starts.
    `auto` is checked as the device it resolves to (resolve_device)."""
    name = resolve_device(name)
    if name == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise DeviceUnavailable(
                f"device cuda: no CUDA device is visible (torch {torch.__version__}: "
                "torch.cuda.is_available() is False)"
            )
    elif name == "npu":
        import importlib.util

        if importlib.util.find_spec("torch_npu") is None:
            raise DeviceUnavailable("device npu: torch_npu is not installed (Ascend needs CANN and torch_npu)")
    elif name != "cpu":
        raise DeviceUnavailable(f"unknown device {name!r}; expected one of {', '.join(BACKENDS)} or 'auto'")


__all__ = ["Backend", "BACKENDS", "DeviceUnavailable", "check_device", "get_backend", "resolve_device"]
