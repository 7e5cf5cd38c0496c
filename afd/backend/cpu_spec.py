"""The CPU's prefetch figures: the last-level cache from the OS, the memory bandwidth measured once.

The CPU backend's prefetch is a read that pulls a weight's lines into the caches (afd.backend.cpu); what
bounds it is how fast memory delivers them (a copy's bandwidth) and how much the largest cache keeps.
"""

from __future__ import annotations

import functools
import os
import time

import torch

from afd.backend.base import PrefetchSpec

CACHE_DIR = "/sys/devices/system/cpu/cpu0/cache"
FALLBACK_CACHE = 8 << 20
"""When the OS says nothing (no sysfs: a container without it, macOS): a common L3 slice, stated as a guess."""
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def last_level_cache(root: str = CACHE_DIR) -> tuple[int, str]:
    """(bytes, where from): the highest-level data or unified cache of cpu0 (Linux sysfs `indexN/size`).
    Shared with the other cores on most CPUs, which is the level a read on one core leaves for a GEMM."""
    best: tuple[int, int] | None = None
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        entries = []
    for name in entries:
        if not name.startswith("index"):
            continue
        try:
            with open(os.path.join(root, name, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(root, name, "level")) as f:
                level = int(f.read())
            with open(os.path.join(root, name, "size")) as f:
                size = _parse_size(f.read().strip())
        except (OSError, ValueError):
            continue
        if kind != "Instruction" and (best is None or level > best[0]):
            best = (level, size)
    if best is None:
        return FALLBACK_CACHE, "no cache size from the OS: 8 MiB assumed"
    return best[1], f"L{best[0]} {best[1] >> 20} MiB ({root})"


def _parse_size(text: str) -> int:
    """sysfs writes sizes as '48K', '2048K', '32M'."""
    unit = _UNITS.get(text[-1:].upper())
    return int(text[:-1]) * unit if unit else int(text)


def copy_bandwidth(nbytes: int = 64 << 20, rounds: int = 3) -> float:
    """Bytes per second one thread copies between two buffers of `nbytes` (the best of `rounds`: the
    other rounds met another process on the core). The buffers are larger than most last-level caches
    per core, so the copy reads memory, as a prefetch of cold weights does."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the prefetch runs on the serving thread: one core's bandwidth
    try:
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return nbytes / best


@functools.cache
def cpu_prefetch_spec() -> PrefetchSpec:
    """Measured once per process (~0.1 s), when an FFN node first sizes its prefetch."""
    cache, where = last_level_cache()
    bw = copy_bandwidth()
    return PrefetchSpec(bw, cache, f"{where}; {bw / 1e9:.1f} GB/s measured copy, one thread")
