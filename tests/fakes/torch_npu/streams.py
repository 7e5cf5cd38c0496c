"""The fake Ascend device's devices and streams: the current device per thread, streams and events.

Streams are modelled. Every op runs on the issuing thread's current stream of its tensors' device (per thread
and per device, as in c10's CUDA and torch_npu's NPU stream pools). Each stream keeps a vector clock; events
carry a copy; `wait_event` merges it. What the clocks order, the memory model checks (memory.py).

The current device is per thread and starts at 0 in a new thread (aclrtSetDevice binds a device to
the calling thread: CANN "aclrtSetDevice", Ascend CANN 8.0 application development guide). APIs that
use the current device implicitly (Event.record(), current_stream(), synchronize() without a device)
in a thread that never called set_device are recorded as `unbound` uses: afd's rule is that every
thread issuing device work binds its node's device first.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time

import torch

from .syncs import STATS, _lock, host_sync

DEVICE_COUNT = int(os.environ.get("AFD_FAKE_NPU_COUNT", "8"))
_local = threading.local()


def _index(device) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    return device.index if device.index is not None else current_device()


# ---- streams, events, clocks ----------------------------------------------------------------------


class Stream:
    """An in-order queue of device work, modelled by its vector clock (what is ordered before its next op)."""

    _ids = itertools.count(1)

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        self = object.__new__(cls)
        self.device_index = _index(device)
        self.device = torch.device("npu", self.device_index)
        self.id = next(Stream._ids)
        self.priority = priority
        self.clock: dict[int, int] = {self.id: 0}
        self.label = kwargs.get("label", f"npu:{self.device_index} stream {self.id}")
        with _lock:  # a device-wide synchronize() waits for every stream, made by torch.npu.Stream() or not
            _all_streams.setdefault(self.device_index, []).append(self)
        return self

    def __repr__(self) -> str:
        return f"<fake {self.label}>"

    def _tick(self) -> int:
        self.clock[self.id] += 1
        return self.clock[self.id]

    def _merge(self, clock: dict[int, int]) -> None:
        for k, v in clock.items():
            if self.clock.get(k, 0) < v:
                self.clock[k] = v

    def _ordered_after(self, stream_id: int, seq: int) -> bool:
        return self.clock.get(stream_id, 0) >= seq

    def wait_event(self, event: Event) -> None:
        with _lock:
            self._merge(event.clock)

    def wait_stream(self, stream: Stream) -> None:
        with _lock:
            self._merge(stream.clock)

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        host_sync("Stream.synchronize")
        _host_waits(self)

    def query(self) -> bool:
        return True


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.clock: dict[int, int] = {}
        self.device_index: int | None = None
        self.enable_timing = enable_timing
        self.time: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        if stream is None:
            _note_implicit("Event.record() without a stream")
            stream = current_stream()
        with _lock:
            self.clock = dict(stream.clock)
            self.device_index = stream.device_index
            self.stream_label = stream.label
            self.time = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        (stream or current_stream()).wait_event(self)

    def synchronize(self) -> None:
        host_sync("Event.synchronize")
        if self.device_index is not None:
            _waited_for(self.stream_label)
            with _lock:
                for s in _all_streams[self.device_index]:
                    s._merge(self.clock)

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds between the two records (torch.npu.Event.elapsed_time, as torch.cuda.Event's: both
        events made with enable_timing=True and recorded). Not a host sync: a real call raises, without
        waiting, on an event not yet complete; the fake's are complete once recorded."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.time is None or end_event.time is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event.time - self.time) * 1000.0


_default_streams: dict[int, Stream] = {}
_all_streams: dict[int, list[Stream]] = {}


def new_stream(device_index: int, label: str) -> Stream:
    """A stream the fake process group owns (its communication stream for one peer pair)."""
    return Stream(device_index, label=label)


def _current_streams() -> dict[int, Stream]:
    if not hasattr(_local, "streams"):
        _local.streams = {}
    return _local.streams


def _note_implicit(what: str) -> None:
    if not getattr(_local, "bound", False) and threading.current_thread() is not threading.main_thread():
        STATS["unbound"].append(
            f"{what} in thread {threading.current_thread().name!r}, which never called "
            "torch.npu.set_device: it acts on device 0"
        )


def _note_unbound(what: str) -> None:
    thread = threading.current_thread().name
    if not any(thread in u for u in STATS["unbound"][-8:]):  # one line per thread and stretch, not per op
        STATS["unbound"].append(
            f"{what} from thread {thread!r}, whose current device is "
            f"npu:{current_device()}: the thread never bound its node's device"
        )


def _waited_for(label: str) -> None:
    with _lock:
        waits = STATS["host_waits"]
        waits[label] = waits.get(label, 0) + 1


def _host_waits(stream: Stream) -> None:
    """The host saw `stream` finish up to now: whatever it issues next, on any stream of the device, is
    ordered after that. Counted per stream (STATS["host_waits"]): a read on the default stream waits for all the
    compute queued there."""
    _waited_for(stream.label)
    with _lock:
        for s in _all_streams[stream.device_index]:
            s._merge(stream.clock)


def current_device() -> int:
    return getattr(_local, "device", 0)


def set_device(device) -> None:
    idx = _index(device if not isinstance(device, str) or ":" in device else torch.device(device, 0))
    if not 0 <= idx < DEVICE_COUNT:
        raise RuntimeError(f"npu:{idx}: invalid device ordinal ({DEVICE_COUNT} devices)")
    _local.device, _local.bound = idx, True


def current_stream(device=None) -> Stream:
    if device is None:
        _note_implicit("torch.npu.current_stream() without a device")
    idx = _index(device)
    return _current_streams().get(idx) or _default_streams[idx]


def default_stream(device=None) -> Stream:
    return _default_streams[_index(device)]


def set_stream(stream: Stream) -> None:
    _current_streams()[stream.device_index] = stream


@contextlib.contextmanager
def stream(s: Stream | None):
    """Makes `s` current and its device the current device, as torch.npu.stream / torch.cuda.stream do."""
    if s is None:
        yield
        return
    streams, prev_dev = _current_streams(), getattr(_local, "device", None)
    prev = streams.get(s.device_index)
    streams[s.device_index], _local.device = s, s.device_index
    try:
        yield
    finally:
        if prev is None:
            streams.pop(s.device_index, None)
        else:
            streams[s.device_index] = prev
        if prev_dev is None:
            del _local.device
        else:
            _local.device = prev_dev


def synchronize(device=None) -> None:
    if device is None:
        _note_implicit("torch.npu.synchronize() without a device")
    idx = _index(device)
    host_sync("torch.npu.synchronize")
    with _lock:
        for s in list(_all_streams[idx]):
            _host_waits(s)
