"""A fake Ascend device for CPU tests: tensors on "npu:N" that compute on the CPU, while the rules of
a real accelerator that afd depends on are checked as the code runs.

What is real: the device type. torch_npu renames PyTorch's PrivateUse1 backend to "npu" and registers
`torch.npu`; so does this module, with a wrapper tensor subclass whose data lives in a CPU tensor.
A CPU tensor meeting an npu tensor in one op fails as it does on the device, and `.tolist()` on an
npu tensor is a device-to-host copy (counted: `STATS["host_reads"]`).

What is counted: host syncs (`STATS["host_syncs"]`, by kind in `host_sync_sites`), every call after which
the host has waited for device work: a device-to-host read, `synchronize()` of a stream, an event or the
device, a blocking communication wait (hccl.py), and a host-to-device copy unless it is `non_blocking` from
pinned memory. PyTorch's copy (aten/src/ATen/native/cuda/Copy.cu, copy_kernel_cuda) synchronizes the stream
after a copy that is not non_blocking; and CUDA stages a non_blocking copy from pageable memory through a
stream sync ("API synchronization behavior", CUDA Runtime API); torch_npu's copy follows the same rules.
Pinning cannot be real here (PrivateUse1's Python hooks, torch._C._acc.PrivateUse1Hooks, offer no pinned
allocator), so `Tensor.pin_memory()` marks the tensor and `is_pinned()` reads the mark.

What is modelled: streams. Every op runs on the issuing thread's current stream of its tensors'
device (per thread and per device, as in c10's CUDA and torch_npu's NPU stream pools). Each stream
keeps a vector clock; events carry a copy; `wait_event` merges it. Every storage remembers its last
writer and the readers since, so an op that reads memory whose write is not ordered before it (RAW),
or overwrites memory still being read elsewhere (WAR), is a hazard: raised at once, and counted.

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
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_map

from . import generator

DEVICE_COUNT = int(os.environ.get("AFD_FAKE_NPU_COUNT", "8"))
STATS = {"ops": 0, "host_reads": 0, "host_syncs": 0, "host_sync_sites": {}, "hazards": [], "unbound": []}
_lock = threading.RLock()
_local = threading.local()


class HazardError(RuntimeError):
    """Device memory used without the stream order that makes it safe on a real device."""


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
        return self

    def __repr__(self) -> str:
        return f"<fake {self.label}>"

    def tick(self) -> int:
        self.clock[self.id] += 1
        return self.clock[self.id]

    def merge(self, clock: dict[int, int]) -> None:
        for k, v in clock.items():
            if self.clock.get(k, 0) < v:
                self.clock[k] = v

    def ordered_after(self, stream_id: int, seq: int) -> bool:
        return self.clock.get(stream_id, 0) >= seq

    def wait_event(self, event: Event) -> None:
        with _lock:
            self.merge(event.clock)

    def wait_stream(self, other: Stream) -> None:
        with _lock:
            self.merge(other.clock)

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
            self.time = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        (stream or current_stream()).wait_event(self)

    def synchronize(self) -> None:
        host_sync("Event.synchronize")
        if self.device_index is not None:
            with _lock:
                for s in _all_streams[self.device_index]:
                    s.merge(self.clock)

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
    s = Stream(device_index, label=label)
    with _lock:
        _all_streams[device_index].append(s)
    return s


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


def host_sync(what: str) -> None:
    """Counts one wait of the host for the device (see the module docstring). With AFD_FAKE_NPU_SYNC_SITES=1,
    each kind is counted per line of afd's code that caused it (where to look on a real device)."""
    if os.environ.get("AFD_FAKE_NPU_SYNC_SITES") == "1":
        what += _afd_caller()
    with _lock:
        STATS["host_syncs"] += 1
        sites = STATS["host_sync_sites"]
        sites[what] = sites.get(what, 0) + 1


def _afd_caller() -> str:
    import traceback

    for frame in reversed(traceback.extract_stack(limit=40)):
        if frame.filename.endswith("backend/host_syncs.py"):  # afd's counter: its caller is the site
            continue
        if any(f"/{pkg}/" in frame.filename for pkg in ("afd", "attention_node", "ffn_node")):
            path = "/".join(frame.filename.rsplit("/", 2)[-2:])
            return f" in {frame.name} at {path}:{frame.lineno}"
    return ""


def _host_waits(stream: Stream) -> None:
    """The host saw `stream` finish up to now: whatever it issues next, on any stream of the device, is
    ordered after that."""
    with _lock:
        for s in _all_streams[stream.device_index]:
            s.merge(stream.clock)


# ---- the torch.npu module ---------------------------------------------------------------------------


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return DEVICE_COUNT


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


# ---- the device's tensors ---------------------------------------------------------------------------


class NpuTensor(torch.Tensor):
    """A tensor on npu:N whose data is the CPU tensor `_payload` (same sizes, strides and storage offset)."""

    @staticmethod
    def __new__(cls, payload: torch.Tensor, index: int):
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            payload.size(),
            strides=payload.stride(),
            storage_offset=payload.storage_offset(),
            dtype=payload.dtype,
            device=torch.device("npu", index),
            requires_grad=payload.requires_grad,
        )
        t._payload = payload
        return t

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"NpuTensor({self._payload!r}, device='{self.device}')"

    def tolist(self):
        return self.cpu().tolist()

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert npu tensor to numpy: copy it to the host first (.cpu())")

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


_NO_CHECK = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}
_TO_DEVICE = (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype_layout)
"""Copies between the host and a device (aten.to.dtype_layout: what .to()/.cpu() dispatch under inference_mode,
where they are not decomposed to _to_copy; it is a view op when it may alias, but across devices it copies)."""
_TO_HOST = {
    torch.ops.aten._to_copy.default,
    torch.ops.aten.to.dtype_layout,
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
}
_READS_INSIDE = {
    # its one-sample path reads `(max < inf) & (min >= 0)` and the rows' sums with .item() before drawing
    # (multinomial_out, aten/src/ATen/native/Distributions.cpp): a host sync on the device
    torch.ops.aten.multinomial.default,
    # Ops whose output size is a device value: the host reads it before it can allocate the result.
    # torch.nonzero and torch.argwhere (which calls it): "When input is on CUDA, this function causes
    # host-device synchronization" (their PyTorch 2.x docs); masked_select and a boolean-mask index go through
    # nonzero (aten/src/ATen/native/TensorAdvancedIndexing.cpp); unique's size is its count of distinct values;
    # bincount reads its input's min and max with .item() (_bincount_cuda_template,
    # aten/src/ATen/native/cuda/SummaryOps.cu). torch_npu's kernels share these semantics. nonzero_static
    # (a fixed size) is the way around, and an index_add_ for counts.
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.bincount.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.unique_dim.default,
    torch.ops.aten.unique_consecutive.default,
}


def _reads_inside(func, args, kwargs) -> bool:
    if func in _READS_INSIDE:
        return True
    # "output_size: ... If given, it will avoid stream synchronization needed to calculate output shape of the
    # tensor" (torch.repeat_interleave, PyTorch 2.x docs)
    repeat = (torch.ops.aten.repeat_interleave.Tensor, torch.ops.aten.repeat_interleave.self_Tensor)
    if func in repeat:
        return kwargs.get("output_size") is None
    # a boolean-mask index: its nonzero runs inside the kernel, out of this dispatcher's sight
    indexing = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default)
    return func in indexing and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ())
    )


def _storage_key(t: torch.Tensor) -> int | None:
    inner = t._payload if isinstance(t, NpuTensor) else t
    ptr = inner.untyped_storage().data_ptr()
    return ptr or None


_shadow: dict[int, list] = {}
"""storage -> accesses [(lo, hi, write, stream id, seq, what)] over byte ranges [lo, hi) of the storage:
disjoint slices of one buffer (one peer's rows, another's) never order against each other."""
_KEEP = 64


def _span(t: torch.Tensor) -> tuple[int, int]:
    p = t._payload if isinstance(t, NpuTensor) else t
    size = p.element_size()
    extent = 1 + sum((n - 1) * st for n, st in zip(p.shape, p.stride())) if p.numel() else 0
    return p.storage_offset() * size, (p.storage_offset() + extent) * size


def _check(stream: Stream, t: NpuTensor, write: bool, what: str) -> None:
    key = _storage_key(t)
    lo, hi = _span(t)
    for alo, ahi, awrite, s_id, seq, awhat in _shadow.get(key, []) if key else []:
        if ahi <= lo or hi <= alo or s_id == stream.id or stream.ordered_after(s_id, seq):
            continue
        if awrite:
            _hazard(
                f"{what} on {stream.label} {'overwrites' if write else 'reads'} memory written by {awhat} "
                f"(stream {s_id}, op {seq}) with no event or stream wait ordering it after that write"
            )
        if write:
            _hazard(
                f"{what} on {stream.label} overwrites memory that {awhat} (stream {s_id}, op {seq}) "
                "may still be reading: nothing orders the write after that read"
            )


def _hazard(message: str) -> None:
    STATS["hazards"].append(message)
    raise HazardError(message)


def _stamp(stream: Stream, seq: int, t: torch.Tensor, write: bool, what: str, fresh: bool = False) -> None:
    key = _storage_key(t)
    if not key:
        return
    lo, hi = _span(t)
    if fresh:
        _shadow[key] = []
    rec = _shadow.setdefault(key, [])
    if write:  # accesses inside a range just overwritten are ordered before this write: forget them
        rec[:] = [a for a in rec if not (lo <= a[0] and a[1] <= hi)]
    rec.append((lo, hi, write, stream.id, seq, what))
    del rec[:-_KEEP]


def access(stream: Stream, reads: list, writes: list, what: str, fresh: list = ()) -> int:
    """Issues one op on `stream` that reads `reads` and writes `writes` (npu tensors), checking its
    order against every earlier access; returns the op's sequence number on the stream."""
    with _lock:
        for t in reads:
            _check(stream, t, False, what)
        for t in writes:
            _check(stream, t, True, what)
        seq = stream.tick()
        for t in reads:
            _stamp(stream, seq, t, False, what)
        for t in writes:
            _stamp(stream, seq, t, True, what)
        for t in fresh:
            _stamp(stream, seq, t, True, what, fresh=True)
        return seq


def _written_args(func, args, kwargs) -> list:
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            out += [x for x in tree_flatten(v)[0] if isinstance(x, NpuTensor)]
    return out


def _run(func, args, kwargs):
    leaves = tree_flatten((args, kwargs))[0]
    generator.check(func, leaves)
    flat = [x for x in leaves if isinstance(x, torch.Tensor)]
    npu = [x for x in flat if isinstance(x, NpuTensor)]
    devices = {x.device.index for x in npu}
    if len(devices) > 1:
        raise RuntimeError(
            f"{func}: Expected all tensors to be on the same device, but found at least two "
            f"devices, npu:{min(devices)} and npu:{max(devices)}!"
        )
    host = [x for x in flat if not isinstance(x, NpuTensor) and x.dim() > 0]
    if host and func not in (torch.ops.aten.copy_.default, *_TO_DEVICE):
        raise RuntimeError(
            f"{func}: Expected all tensors to be on the same device, but found at least two "
            f"devices, npu:{min(devices)} and cpu!"
        )
    index = devices.pop()

    def unwrap(x):
        if isinstance(x, NpuTensor):
            return x._payload
        if isinstance(x, torch.device) and x.type == "npu":
            return torch.device("cpu")
        return x

    to_host = (
        func in _TO_HOST
        and not (func in _TO_DEVICE and torch.device(kwargs.get("device") or "npu").type == "npu")
        or func is torch.ops.aten.copy_.default
        and not isinstance(args[0], NpuTensor)
    )
    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    if (func in _NO_CHECK or func.is_view) and not to_host:  # views touch metadata only, never the data
        return tree_map(lambda x: _wrap(x, index, npu), out)
    if getattr(_local, "device", None) != index and threading.current_thread() is not threading.main_thread():
        _note_unbound(f"{func.__name__} on npu:{index}")
    stream = current_stream(index)
    written = _written_args(func, args, kwargs)
    result = out if to_host else tree_map(lambda x: _wrap(x, index, npu), out)
    fresh = [
        x
        for x in tree_flatten(result)[0]
        if isinstance(x, NpuTensor) and not any(x is a for a in npu) and not any(x is w for w in written)
    ]
    STATS["ops"] += 1
    access(
        stream,
        [x for x in npu if not any(x is w for w in written)],
        written,
        str(func.__name__),
        fresh=[x for x in fresh if not _aliases_input(x, npu)],
    )
    if to_host and func is torch.ops.aten.copy_.default and _async_to_host(args, kwargs):
        STATS["host_reads"] += 1  # queued on the stream; the host reads the buffer after an event says so
    elif to_host or _reads_inside(func, args, kwargs):
        STATS["host_reads"] += 1
        host_sync(f"device-to-host read ({func.__name__})")
        _host_waits(stream)
    elif func is torch.ops.aten.copy_.default and not isinstance(args[1], NpuTensor):
        _host_to_device(args[1], kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
    return result


def _async_to_host(args, kwargs) -> bool:
    """dst.copy_(npu_src, non_blocking=True) into pinned host memory: queued on the stream, no host wait.
    PyTorch's copy_kernel_cuda (aten/src/ATen/native/cuda/Copy.cu) synchronizes the stream only when the copy
    is not non_blocking, and records an event for the pinned block instead; into pageable memory CUDA makes the
    copy synchronous ("API synchronization behavior", CUDA Runtime API). The fake copies at once, so a host
    that reads the buffer before an event says the copy landed is not caught here."""
    non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
    return bool(non_blocking) and is_pinned(args[0])


def _host_to_device(src: torch.Tensor, non_blocking: bool) -> None:
    if src.numel() == 0:  # PyTorch's copy_ returns before any device work for an empty tensor
        return
    if not non_blocking:
        host_sync("host-to-device copy without non_blocking")
    elif not is_pinned(src):
        host_sync("non_blocking host-to-device copy from pageable memory")


def _aliases_input(x: NpuTensor, inputs: list) -> bool:
    key = _storage_key(x)
    return any(_storage_key(a) == key for a in inputs)


def _wrap(x, index: int, inputs: list):
    if not isinstance(x, torch.Tensor) or isinstance(x, NpuTensor):
        return x
    for a in inputs:  # an in-place op or out= returns its argument: hand back the same wrapper
        if a._payload is x:
            return a
    # Made as a normal tensor even under inference_mode: autograd sets a view's version counter from
    # its base after this returns, which an inference-mode wrapper refuses.
    with torch.inference_mode(False):
        return NpuTensor(x, index)


def _factory(op):
    def impl(*args, device=None, **kwargs):
        kwargs.pop("pin_memory", None)
        t = NpuTensor(op(*args, **kwargs), _index(device))
        access(current_stream(t.device.index), [], [], op.__name__, fresh=[t])
        return t

    return impl


def _copy_from(src, dst, non_blocking=False):
    """Host <-> device copies (Tensor.to, .cpu(), copy_ across devices) land here."""
    s = src._payload if isinstance(src, NpuTensor) else src
    d = dst._payload if isinstance(dst, NpuTensor) else dst
    d.copy_(s)
    dev = dst if isinstance(dst, NpuTensor) else src
    stream = current_stream(dev.device.index)
    access(stream, [src] if isinstance(src, NpuTensor) else [], [dst] if isinstance(dst, NpuTensor) else [], "copy_")
    if not isinstance(dst, NpuTensor):
        STATS["host_reads"] += 1
        host_sync("device-to-host copy")
        _host_waits(stream)
    elif not isinstance(src, NpuTensor):
        _host_to_device(src, non_blocking)
    return dst


# ---- pinned host memory (marked, see the module docstring) ------------------------------------------

_pinned: set[tuple[int, int]] = set()


def _pin_memory(self: torch.Tensor, device=None) -> torch.Tensor:
    if isinstance(self, NpuTensor):
        raise RuntimeError("cannot pin 'npu' memory: only dense CPU tensors can be pinned")
    t = self.clone()
    key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
    with _lock:
        _pinned.add(key)
    weakref.finalize(t, _pinned.discard, key)  # freed memory may come back pageable at the same address
    return t


def is_pinned(t: torch.Tensor, device=None) -> bool:
    if isinstance(t, NpuTensor) or t.untyped_storage().nbytes() == 0:
        return False
    ptr = t.untyped_storage().data_ptr()
    with _lock:
        return any(p <= ptr < p + n for p, n in _pinned)


_lib = None


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
    _lib.impl("_copy_from", _copy_from, "PrivateUse1")
    torch.Tensor.pin_memory = _pin_memory
    torch.Tensor.is_pinned = is_pinned
    for i in range(DEVICE_COUNT):
        _default_streams[i] = Stream(i, label=f"npu:{i} default stream")
        _all_streams[i] = [_default_streams[i]]
