"""Memory back to the system after a large request. A 30 MB body passes through several copies (bytes, the
parsed str, its UTF-8 form for the byte bound); glibc serves blocks that size from its heaps once its mmap
threshold has risen past them, and keeps the freed pages: without a trim the node's RSS stayed 5x higher. Even
trimmed, a heap that served such blocks from a worker thread's arena (the chat template renders there) kept
about 2x the body (+60 MB for a 30 MB conversation, the second time one came), so the threshold is also fixed
(MMAP_THRESHOLD): blocks that large are mapped on their own and go back to the system when freed."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging

log = logging.getLogger("afd.api")

TRIM_ABOVE = 1 << 20
"""Bodies over this many bytes are followed by a trim (malloc_trim walks every heap: not for each request)."""
MMAP_THRESHOLD = 4 << 20
"""Blocks at least this large are mmapped (glibc's M_MMAP_THRESHOLD, fixed: no longer raised by each free of a
mapped block, up to 32 MiB). Above a decode step's activations on the models afd serves on CPU, below a body
worth trimming for."""
_M_MMAP_THRESHOLD = -3  # glibc malloc.h


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library is another (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_TRIM = _malloc_trim()


def fix_mmap_threshold(size: int = MMAP_THRESHOLD) -> bool:
    """glibc's mallopt(M_MMAP_THRESHOLD, size); False where the C library is another (or refuses it)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallopt
    except (OSError, AttributeError):
        return False
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn(_M_MMAP_THRESHOLD, size) == 1


def trim() -> None:
    """Returns free heap pages to the system. ctypes releases the GIL for the call."""
    if _TRIM is not None:
        _TRIM(0)


class TrimAfterLargeBodies:
    """ASGI middleware: once a request whose body passed TRIM_ABOVE bytes has been answered (its body, parsed
    copies and token lists unreferenced by then), trims the heap on a worker thread."""

    def __init__(self, app, threshold: int = TRIM_ABOVE):
        self.app, self.threshold = app, threshold

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        received = 0

        async def counting():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            return message

        try:
            await self.app(scope, counting, send)
        finally:
            if received > self.threshold:  # not awaited: the response is out, and a cancelled task must not wait
                asyncio.get_running_loop().run_in_executor(None, trim)
