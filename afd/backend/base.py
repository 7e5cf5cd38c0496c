"""The device interface: everything device-specific that afd's model, runner and transport use."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod

import torch


def grouped_matmul_by_slices(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """One GEMM per non-empty group over its contiguous row slice of x (reads the sizes on the host)."""
    out = x.new_empty(x.shape[0], w.shape[-1])
    start = 0
    for g, n in enumerate(group_sizes.tolist()):
        if n:
            torch.mm(x[start:start + n], w[g], out=out[start:start + n])
            start += n
    return out



class DeviceUnavailable(ValueError):
    """The device asked for is not on this machine (said in one line, not a traceback)."""

class Backend(ABC):
    """One device family. Implementations import their SDKs lazily, inside their own module."""

    name: str
    dist_backend: str
    """torch.distributed backend for the data plane: gloo, nccl or hccl."""

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    def synchronize(self) -> None:
        """Wait for all queued device work (no-op where ops are synchronous)."""

    def comm_stream(self):
        """The side stream data-plane ops are issued on, or None where the transport is already async."""
        return None

    def stream_scope(self, stream) -> contextlib.AbstractContextManager:
        """Make `stream` current for the ops issued inside the scope."""
        return contextlib.nullcontext()

    def record_event(self):
        """An event marking the work queued so far on the current stream (None where not needed)."""
        return None

    def wait_event(self, event, stream=None) -> None:
        """Order `stream` (default: current) after `event`."""

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        return (0, 0)

    @abstractmethod
    def grouped_matmul(self, x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        """x [T, K] with rows sorted by group; w [G, K, N]; group_sizes [G] int64 row counts on x's device
        (they stay there: a device backend never reads them on the host). Returns [T, N], group g's rows
        times w[g]."""

    prefetch_by_default: bool = False
    """Whether FFN nodes prefetch weights unless the YAML says otherwise (see docs/benchmarks.md)."""

    def prefetch(self, weight: torch.Tensor, max_bytes: int) -> int:
        """Hint that the first `max_bytes` of `weight` are needed soon; returns the bytes hinted (0: no-op).
        No numerical effect."""
        return 0

    def compile(self, fn):
        """Graph-compile `fn` where the device benefits; identity by default."""
        return fn
