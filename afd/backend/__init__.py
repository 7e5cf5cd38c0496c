"""Device backends. `get_backend` constructs one lazily; only the chosen backend's SDK is imported."""

from __future__ import annotations

from typing import TYPE_CHECKING

from afd.backend.devices import BACKENDS, DeviceUnavailable, check_device, check_devices, resolve_device

if TYPE_CHECKING:
    from afd.backend.base import Backend


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


def __getattr__(name: str):
    # Backend's module imports torch; resolving or checking a device name does not need it
    if name == "Backend":
        from afd.backend.base import Backend

        return Backend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Backend",
    "BACKENDS",
    "DeviceUnavailable",
    "check_device",
    "check_devices",
    "get_backend",
    "resolve_device",
]
