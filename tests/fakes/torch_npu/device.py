"""A fake Ascend device for CPU tests: tensors on "npu:N" that compute on the CPU, while the rules of
a real accelerator that afd depends on are checked as the code runs.

This module is `torch.npu`: torch_npu renames PyTorch's PrivateUse1 backend to "npu" and registers
`torch.npu`, and so does `install` here, with this module. The device's parts, each saying which behaviour
of the real device it reproduces and where that is documented:
- streams.py: the current device per thread, streams with vector clocks, events (`torch.npu.Stream`, ...);
- memory.py: the npu tensors (a wrapper subclass over CPU tensors), the stream order every op's reads and
  writes must keep (hazards), host <-> device copies and pinned host memory;
- syncs.py: what the device counts (`STATS`), above all the host syncs.
Their names are all bound here as well, as they were when this was one module: `torch.npu.<name>` and
`torch_npu.device.<name>` reach each of them.
"""

from __future__ import annotations

import torch

from .memory import (  # noqa: F401  (torch.npu.<name>)
    _KEEP,
    _NO_CHECK,
    HazardError,
    NpuTensor,
    _aliases_input,
    _async_to_host,
    _check,
    _copy_from,
    _factory,
    _hazard,
    _host_to_device,
    _pin_memory,
    _pinned,
    _run,
    _shadow,
    _span,
    _stamp,
    _storage_key,
    _wrap,
    _written_args,
    access,
    is_pinned,
)
from .streams import (  # noqa: F401  (torch.npu.<name>)
    DEVICE_COUNT,
    Event,
    Stream,
    _all_streams,
    _current_streams,
    _default_streams,
    _host_waits,
    _index,
    _local,
    _note_implicit,
    _note_unbound,
    current_device,
    current_stream,
    default_stream,
    new_stream,
    set_device,
    set_stream,
    stream,
    synchronize,
)
from .syncs import (  # noqa: F401  (torch.npu.<name>)
    _READS_INSIDE,
    _TO_DEVICE,
    _TO_HOST,
    STATS,
    _afd_caller,
    _lock,
    _reads_inside,
    get_sync_debug_mode,
    host_sync,
    set_sync_debug_mode,
)

# ---- the torch.npu module ---------------------------------------------------------------------------


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return DEVICE_COUNT


def mem_get_info(device=None) -> tuple[int, int]:
    return (32 << 30, 64 << 30)


def manual_seed_all(seed: int) -> None:
    pass


def get_device_name(device=None) -> str:
    return "fake Ascend (CPU)"


class _DeviceProperties:
    """torch_npu's _NPUDeviceProperties, with the fields the fake can state; no L2_cache_size, which not
    every torch_npu release reports, so that afd's fallback figure is what the fake exercises."""

    def __init__(self, index: int):
        self.name, self.total_memory = get_device_name(index), mem_get_info(index)[1]


def get_device_properties(device=None) -> _DeviceProperties:
    return _DeviceProperties(_index(device))


_lib = None


FAKE_ONLY = (
    "DEVICE_COUNT", "HazardError", "NpuTensor", "STATS", "access", "host_sync", "install", "is_pinned", "new_stream",
    "FAKE_ONLY",
)  # fmt: skip
"""Public names of this `torch.npu` that torch_npu's has not: the fake device's size, checks and counters, and the
helpers the fake's other modules share. Every other public name is torch_npu 2.14.0's torch_npu.npu's
(tests/test_vendor_npu.py holds both)."""


def install() -> None:
    """Registers the device: once per process, as importing torch_npu does."""
    global _lib
    if _lib is not None:
        return
    import sys

    import torch.utils.backend_registration as reg

    module = sys.modules[__name__]
    reg._setup_privateuseone_for_python_backend(rename="npu", backend_module=module)
    _lib = torch.library.Library("aten", "IMPL")
    _lib.impl("empty.memory_format", _factory(torch.empty), "PrivateUse1")
    _lib.impl("empty_strided", _factory(torch.empty_strided), "PrivateUse1")
    for arange in ("arange", "arange.start", "arange.start_step"):  # else empty(0), then an out= op that resizes it
        _lib.impl(arange, _factory(torch.arange), "PrivateUse1")
    _lib.impl("_copy_from", _copy_from, "PrivateUse1")
    torch.Tensor.pin_memory = _pin_memory
    torch.Tensor.is_pinned = is_pinned
    for i in range(DEVICE_COUNT):
        _default_streams[i] = Stream(i, label=f"npu:{i} default stream")
