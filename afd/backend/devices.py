"""Device names: which device `auto` means here, and whether a named one is here. Importing this module
does not import torch (`afd serve` decides its device before any node process starts)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import sys

BACKENDS = ("cpu", "cuda", "npu")

log = logging.getLogger("afd.backend")


class DeviceUnavailable(ValueError):
    """The device asked for is not on this machine (said in one line, not a traceback)."""


def resolve_device(name: str) -> str:
    """`auto` as the device it means here: npu when torch_npu imports and sees an NPU, else cuda when
    torch sees a GPU, else cpu. Any other name is returned as it is. The one place `auto` is decided."""
    if name != "auto":
        return name
    if _npu_available():
        return "npu"
    if "torch" not in sys.modules and _cpu_only_torch():
        return "cpu"  # without importing torch (seconds): a CPU-only build sees no GPU
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _npu_available() -> bool:
    """torch_npu is imported here, on demand only: importing afd never imports a device SDK."""
    if importlib.util.find_spec("torch_npu") is None:
        return False  # not installed
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


def _cpu_only_torch() -> bool:
    """Whether the installed torch is a CPU-only build (PyTorch's CPU wheels carry the local version "+cpu")."""
    try:
        return importlib.metadata.version("torch").endswith("+cpu")
    except importlib.metadata.PackageNotFoundError:
        return False


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
        if importlib.util.find_spec("torch_npu") is None:
            raise DeviceUnavailable("device npu: torch_npu is not installed (Ascend needs CANN and torch_npu)")
    elif name != "cpu":
        raise DeviceUnavailable(f"unknown device {name!r}; expected one of {', '.join(BACKENDS)} or 'auto'")
