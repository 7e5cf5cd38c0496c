"""Host syncs: every place afd reads a device value on the host or waits for the device counts here, and
each node exports the count as `afd_host_syncs_total`, the first thing to look at on real hardware (a decode
step should cost one per node: docs/architecture/backends.md). CPU tensors cost nothing and are not counted.
"""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_count = 0


def note(device: torch.device, n: int = 1) -> None:
    """`n` host syncs on `device` (nothing on CPU, where the host is the device)."""
    global _count
    if device.type != "cpu":
        with _lock:
            _count += n


def total() -> int:
    return _count


def to_list(t: torch.Tensor) -> list:
    """t.tolist(), counted."""
    note(t.device)
    return t.tolist()


def to_int(t: torch.Tensor) -> int:
    """int(t) of a one-element tensor, counted."""
    note(t.device)
    return int(t)
