"""Device names: which device `auto` means here, and whether a named one is here. Importing this module
does not import torch (`afd serve` decides its device before any node process starts)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import sys
from collections.abc import Iterable

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
    `auto` is checked as the device it resolves to (resolve_device); `cuda:N` / `npu:N` also needs N below
    the count of that kind's devices this process sees."""
    check_devices([name])


def check_devices(names: Iterable[str]) -> None:
    """check_device for every name at once: each kind is checked once, and every index at or beyond its
    kind's device count is named in the one line (`device cuda:5: this machine has 2 CUDA devices
    (cuda:0-1)`). The launchers call it with every process's device before any process starts."""
    indices: dict[str, set[int]] = {}
    for name in names:
        kind, colon, index = resolve_device(name).partition(":")
        if kind not in BACKENDS or (colon and not index.isdigit()):
            raise DeviceUnavailable(f"unknown device {name!r}; expected one of {', '.join(BACKENDS)} or 'auto'")
        indices.setdefault(kind, set()).update([int(index)] if colon else [])
    for kind in sorted(indices):
        _check_kind(kind)
        if kind == "cpu" or not indices[kind]:
            continue
        check_indices(kind, indices[kind], _device_count(kind))


def check_indices(kind: str, indices: Iterable[int], count: int) -> None:
    """Raises DeviceUnavailable naming every index of `kind` at or beyond `count`, in one line (a node
    process would otherwise die in set_device with a traceback)."""
    beyond = sorted(i for i in set(indices) if i >= count)
    if beyond:
        raise DeviceUnavailable(_beyond_the_count(kind, beyond, count))


def _check_kind(kind: str) -> None:
    if kind == "cuda" and "torch" not in sys.modules and _cpu_only_torch():
        version = importlib.metadata.version("torch")  # not imported: a CPU build answers in milliseconds
        raise DeviceUnavailable(f"device cuda: no CUDA device is visible (torch {version} is a CPU-only build)")
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise DeviceUnavailable(
                f"device cuda: no CUDA device is visible (torch {torch.__version__}: "
                "torch.cuda.is_available() is False)"
            )
    elif kind == "npu" and importlib.util.find_spec("torch_npu") is None:
        raise DeviceUnavailable("device npu: torch_npu is not installed (Ascend needs CANN and torch_npu)")


VISIBLE_DEVICES_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}
"""The variable that narrows which devices of a kind a process sees (and renumbers them from 0)."""


def _device_count(kind: str) -> int:
    """How many `kind` devices this process sees: torch's count, after VISIBLE_DEVICES_ENV. torch (and for
    npu torch_npu) is imported here, only when a device index is to be checked."""
    import torch

    if kind == "npu":
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except Exception as e:
            raise DeviceUnavailable(f"device npu: torch_npu is not importable ({type(e).__name__}: {e})") from None
    return int(getattr(torch, kind).device_count())


def _beyond_the_count(kind: str, beyond: list[int], count: int) -> str:
    names = ", ".join(f"{kind}:{i}" for i in beyond)
    label = kind.upper()
    env = VISIBLE_DEVICES_ENV[kind]
    if count == 0:
        have = f"no {label} device"
    elif count == 1:
        have = f"1 {label} device ({kind}:0)"
    else:
        have = f"{count} {label} devices ({kind}:0-{count - 1})"
    if os.environ.get(env) is not None:  # then the indices count the visible devices only
        return f"device{'s' if len(beyond) > 1 else ''} {names}: {env}={os.environ[env]} leaves {have}"
    return f"device{'s' if len(beyond) > 1 else ''} {names}: this machine has {have}"
