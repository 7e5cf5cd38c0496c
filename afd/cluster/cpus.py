"""How many CPUs this process may use: what thread counts are sized by.

os.cpu_count() is the host's core count. Inside a container that is wrong twice over: the CPU set may be
narrowed (affinity, e.g. the kubelet's static CPU manager) and a CPU limit becomes a CFS quota in the
cgroup, so N threads on a 2-CPU limit are throttled instead of running in parallel.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 mounts the cpu controller under one of these names (often one a link to the other).
_V1_DIRS = ("cpu", "cpu,cpuacct")


def usable_cpus(cgroup_root: str | Path = CGROUP_ROOT) -> int:
    """The CPUs this process may use: its affinity set, capped by the cgroup CPU quota (rounded up, at
    least 1). `cgroup_root` is a parameter so that tests can point it at fake files."""
    n = _affinity_cpus()
    quota = cgroup_cpu_limit(Path(cgroup_root))
    if quota is not None:
        n = min(n, quota)
    return max(1, n)


def cgroup_cpu_limit(root: Path) -> int | None:
    """The cgroup's CPU quota in whole CPUs (rounded up), or None when there is none or it is unreadable:
    cgroup v2 `cpu.max` first, then v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`."""
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        return _ceil_ratio(quota, period or "100000")
    for d in _V1_DIRS:
        q, p = _read(root / d / "cpu.cfs_quota_us"), _read(root / d / "cpu.cfs_period_us")
        if q is not None and p is not None:
            return _ceil_ratio(q, p)
    return None


def _affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity on macOS and Windows
        return os.cpu_count() or 1


def _ceil_ratio(quota: str, period: str) -> int | None:
    """quota/period rounded up; None for "max" (v2) or -1 (v1), which mean no limit, and for garbage."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    if q <= 0 or p <= 0:
        return None
    return max(1, math.ceil(q / p))


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds process `pid` has run, every thread of it, user and system (utime + stime of /proc/PID/stat,
    https://man7.org/linux/man-pages/man5/proc_pid_stat.5.html); 0.0 once it is gone or off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def thread_schedstat(pid: int) -> dict[int, tuple[float, float]]:
    """Per thread of process `pid` (thread id -> seconds on a CPU, seconds runnable but waiting on a run queue),
    from /proc/PID/task/TID/schedstat (https://docs.kernel.org/scheduler/sched-stats.html); {} once it is gone,
    off Linux, or where the kernel keeps no schedstats."""
    out: dict[int, tuple[float, float]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run, wait = f.read().split()[:2]
            out[int(tid)] = (int(run) / 1e9, int(wait) / 1e9)
        except (OSError, ValueError):
            continue  # a thread that ended between the listing and the read
    return out
