"""What memory a CPU node may still take: /proc/meminfo's MemAvailable (free plus the page cache the kernel
gives back), capped by the cgroup's memory limit. In a pod with a memory limit the host's figures overstate
it; a KV cache sized from them is killed by the OOM killer instead of being refused with a reason."""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60
"""cgroup v1 writes a 'no limit' memory.limit_in_bytes as a page-rounded 2^63-1: anything this large is none."""


def memory_info(meminfo: str | Path = "/proc/meminfo", cgroup_root: str | Path = CGROUP_ROOT) -> tuple[int, int]:
    """(available, total) bytes; the paths are parameters so that tests can point them at fake files."""
    total, free = _meminfo(Path(meminfo))
    limit, used = _cgroup(Path(cgroup_root))
    if limit is not None:
        total = min(total, limit)
        free = min(free, max(0, limit - (used or 0)))
    return free, total


def _meminfo(path: Path) -> tuple[int, int]:
    fields = {}
    try:
        for line in path.read_text().splitlines():
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                fields[name] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        pass
    page = os.sysconf("SC_PAGE_SIZE")
    total = fields.get("MemTotal") or page * os.sysconf("SC_PHYS_PAGES")
    free = fields.get("MemAvailable") or page * os.sysconf("SC_AVPHYS_PAGES")
    return total, free


def _cgroup(root: Path) -> tuple[int | None, int | None]:
    """(limit, usage): cgroup v2 memory.max / memory.current, else v1's memory/ files; None: no limit."""
    v1 = ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")
    for limit_f, used_f in (("memory.max", "memory.current"), v1):
        limit = _int(root / limit_f)
        if limit is not None:
            return (limit if limit < _UNLIMITED else None), _int(root / used_f)
    return None, None


def _int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2's "max": no limit
