"""The fake Ascend device's memory: tensors on "npu:N" that compute on the CPU, the order every op's reads
and writes keep, copies between the host and the device, and pinned host memory.

What is real: the device type. torch_npu renames PyTorch's PrivateUse1 backend to "npu" and registers
`torch.npu` (device.py); the tensors are a wrapper tensor subclass whose data lives in a CPU tensor.
A CPU tensor meeting an npu tensor in one op fails as it does on the device, and `.tolist()` on an
npu tensor is a device-to-host copy (counted: `STATS["host_reads"]`, with the host syncs of syncs.py).

What is modelled: every storage remembers its last writer and the readers since, so an op that reads memory
whose write is not ordered before it by the streams' clocks (streams.py) (RAW), or overwrites memory still
being read elsewhere (WAR), is a hazard: raised at once, and counted.

Pinning cannot be real here (PrivateUse1's Python hooks, torch._C._acc.PrivateUse1Hooks, offer no pinned
allocator), so `Tensor.pin_memory()` marks the tensor and `is_pinned()` reads the mark.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_map

from . import generator
from .streams import Stream, _host_waits, _index, _local, _note_unbound, current_stream
from .syncs import _TO_DEVICE, _TO_HOST, STATS, _lock, _reads_inside, host_sync


class HazardError(RuntimeError):
    """Device memory used without the stream order that makes it safe on a real device."""


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

    @property
    def data(self):
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value):
        """`param.data = t`: on a device the parameter takes t's storage and sizes; a wrapper must take its
        payload too, else it keeps the old data behind the new sizes."""
        torch._C.TensorBase.data.__set__(self, value)
        self._payload = value._payload

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert npu tensor to numpy: copy it to the host first (.cpu())")

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


_NO_CHECK = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}


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
        if ahi <= lo or hi <= alo or s_id == stream.id or stream._ordered_after(s_id, seq):
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
        seq = stream._tick()
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
    _refuse_resized(func, npu)
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


def _refuse_resized(func, npu: list) -> None:
    """An out= op that resized its output (torch.cat(..., out=empty)): on a device the tensor takes the new size,
    but a wrapper's sizes are fixed when it is made, so the fake would go on with the old ones, silently (a
    tensor of 0 elements where the op made 6). It says so instead."""
    for x in npu:
        p = x._payload
        if p.shape != x.shape or p.stride() != x.stride() or p.storage_offset() != x.storage_offset():
            raise RuntimeError(
                f"fake npu: {func} resized its output on npu:{x.device.index} from {tuple(x.shape)} to "
                f"{tuple(p.shape)}, which the fake cannot model: give it an output of the right size"
            )


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
