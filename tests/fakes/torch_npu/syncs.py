"""What the fake device counts (`STATS`), and which of its work makes the host wait for it: the host-sync
accounting of the fake Ascend device (device.py).

Host syncs (`STATS["host_syncs"]`, by kind in `host_sync_sites`) are every call after which the host has
waited for device work: a device-to-host read, `synchronize()` of a stream, an event or the device, a blocking
communication wait (hccl.py), and a host-to-device copy unless it is `non_blocking` from pinned memory (the
copies: memory.py). PyTorch's copy (aten/src/ATen/native/cuda/Copy.cu, copy_kernel_cuda) synchronizes the
stream after a copy that is not non_blocking; and CUDA stages a non_blocking copy from pageable memory through a
stream sync ("API synchronization behavior", CUDA Runtime API); torch_npu's copy follows the same rules. The
aten ops that read device memory on the host, by what they are or inside their kernels, are listed here.
"""

from __future__ import annotations

import os
import threading

import torch

STATS = {
    "ops": 0, "host_reads": 0, "host_syncs": 0, "host_sync_sites": {}, "host_waits": {}, "hazards": [], "unbound": [],
}  # fmt: skip
_lock = threading.RLock()


_SYNC_DEBUG = {"default": 0, "warn": 1, "error": 2}
_sync_debug_mode = 0
SYNC_MESSAGE = "called a synchronizing NPU operation"
"""The text libtorch_npu.so warns or raises with (a string in torch_npu 2.14.0's library)."""


def set_sync_debug_mode(debug_mode) -> None:
    """torch.npu.set_sync_debug_mode (torch_npu 2.14.0's torch_npu/npu/utils.py): "default"/0 nothing, "warn"/1 a
    warning at each synchronizing operation, "error"/2 a RuntimeError; anything else a RuntimeError. The fake's
    synchronizing operations are its host syncs (host_sync below)."""
    global _sync_debug_mode
    if isinstance(debug_mode, str):
        if debug_mode not in _SYNC_DEBUG:
            raise RuntimeError("invalid value of debug_mode, expected one of `default`, `warn`, `error`")
        debug_mode = _SYNC_DEBUG[debug_mode]
    _sync_debug_mode = int(debug_mode)


def get_sync_debug_mode() -> int:
    return _sync_debug_mode


def host_sync(what: str) -> None:
    """Counts one wait of the host for the device (see the module docstring). With AFD_FAKE_NPU_SYNC_SITES=1,
    each kind is counted per line of afd's code that caused it (where to look on a real device). Under
    set_sync_debug_mode, warns or raises first, as the runtime does."""
    if _sync_debug_mode == 2:
        raise RuntimeError(SYNC_MESSAGE)
    if _sync_debug_mode == 1:
        import warnings

        warnings.warn(SYNC_MESSAGE, UserWarning, stacklevel=2)
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
