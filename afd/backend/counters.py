"""Counters that a node's hot path adds to on its device and that the metrics scrape reads, without a host sync
on the hot path and without the scrape waiting behind the compute stream.

A plain `.tolist()` from the scrape thread runs on that thread's current stream, the device's default one: the
read waits for everything queued there, and on CUDA the legacy default stream also orders itself against every
blocking stream. Here the scrape copies on a stream of its own, ordered after the last add only (an event the
adder records), into pinned memory, and waits for that copy alone. The adder's next add waits, on the device, for
the copy to have read the counters (WAR), so neither side races the other and neither blocks the host.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from afd.backend import host_syncs
from afd.backend.base import bind_device, to_device


class DeviceCounter:
    """int64 counters [n]: `add` from one thread (the node's compute loop), `read` from any other."""

    def __init__(self, n: int):
        self.value = torch.zeros(n, dtype=torch.int64)
        self._lock = threading.Lock()  # held only to enqueue: never across a wait
        self._reading = threading.Lock()  # one scrape at a time owns the host buffer
        self._written: Any = None  # event after the last add, on the adder's stream (the runtime's Event)
        self._read: Any = None  # event after the scrape's copy, on the scrape's stream: the next add waits for it
        self._stream: Any = None  # the scrape's own stream (the runtime's Stream)
        self._host: torch.Tensor | None = None

    def add(self, *parts: tuple[int, torch.Tensor]) -> None:
        """value[at : at + len(x)] += x for each (at, x); every x on one device (the first add's moves the
        counters there); an x may also be a list."""
        parts = tuple((at, torch.as_tensor(x)) for at, x in parts)
        device = parts[0][1].device
        with self._lock:
            if self.value.device != device:
                self.value = to_device(self.value, device)
            if device.type == "cpu":
                self._add(parts)
                return
            runtime = getattr(torch, device.type)
            stream = runtime.current_stream(device)
            if self._read is not None:
                stream.wait_event(self._read)
                self._read = None
            self._add(parts)
            if self._written is None:
                self._written = runtime.Event()
            self._written.record(stream)

    def _add(self, parts) -> None:
        for at, x in parts:
            x = x.reshape(-1)
            self.value[at : at + len(x)] += x

    def read(self) -> list[int]:
        """The counters as of the last add whose event the copy saw; one host sync, on the scrape's own stream."""
        with self._reading:
            device = self.value.device
            if device.type == "cpu":
                with self._lock:
                    return self.value.tolist()
            runtime = getattr(torch, device.type)
            bind_device(device)
            with self._lock:
                if self._stream is None or self._host is None or self._host.shape != self.value.shape:
                    self._stream = runtime.Stream(device)
                    self._host = torch.empty(self.value.shape, dtype=torch.int64).pin_memory()
                with runtime.stream(self._stream):
                    if self._written is not None:
                        self._stream.wait_event(self._written)
                    self._host.copy_(self.value, non_blocking=True)
                    done = runtime.Event()
                    done.record(self._stream)
                self._read = done
            host_syncs.note(device)
            done.synchronize()
            return self._host.tolist()
