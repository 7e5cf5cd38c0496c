"""What every device check shares: where it runs (Target), printing, and running one check so that an
exception fails that row, not the run."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from device_report import Result

ROOT = Path(__file__).resolve().parents[2]
# a device node creates its context, loads, and forms NCCL/HCCL before its API answers
CLUSTER_READY_TIMEOUT = 240


@dataclass
class Target:
    """Where the device checks run: kind is cuda, npu, or cpu (the --device cpu dry run)."""

    kind: str
    count: int

    @property
    def dist(self) -> str:
        return {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}[self.kind]

    def node_devices(self) -> tuple[str, str] | None:
        """(attention, FFN) devices of a 1A1F cluster, or None where it cannot form. On one GPU both nodes share
        it (cluster.share_devices: each gets an NCCL_HOSTID of its own, and NCCL connects them as two hosts,
        over sockets), so the pair's failure semantics are still tried; HCCL takes one rank per device."""
        if self.kind == "cpu":
            return "cpu", "cpu"
        if self.count >= 2:
            return f"{self.kind}:0", f"{self.kind}:1"
        return (f"{self.kind}:0", f"{self.kind}:0") if self.kind == "cuda" and self.count == 1 else None

    @property
    def shared(self) -> bool:
        """Both nodes of the 1A1F cluster on one device: its pair goes over sockets, not P2P."""
        devices = self.node_devices()
        return devices is not None and self.kind != "cpu" and devices[0] == devices[1]

    def too_few_devices(self) -> str:
        return (
            f"{self.count} {self.kind} device here: 1A1F needs 2 (attention on {self.kind}:0, FFN on "
            f"{self.kind}:1; HCCL takes one process per device, and only CUDA nodes may share one)"
        )


def wait_ready(cluster, timeout: float = CLUSTER_READY_TIMEOUT) -> None:
    """cluster_helpers.Cluster.wait_ready, its AssertionError (every node's whole log) printed and cut to its
    first line for the table."""
    try:
        cluster.wait_ready(timeout)
    except AssertionError as e:
        say(str(e))
        raise RuntimeError(str(e).splitlines()[0]) from None


def say(msg: str) -> None:
    print(msg, flush=True)


def guarded(fn: Callable[[], Result], name: str, measured: str = "") -> Result:
    """One check, timed; an exception is that check's failure, not the end of the run."""
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception as e:
        traceback.print_exc()
        result = Result(name, "fail", f"{type(e).__name__}: {e}")
    result.measured = result.measured or measured
    result.seconds = round(time.perf_counter() - t0, 2)
    return result


def announce(result: Result) -> Result:
    say(f"[{result.status}] {result.check}: {result.reason}")
    return result


def median_ms(backend, fn: Callable[[], object], calls: int = 20) -> float:
    """fn's median wall time in ms over `calls` calls after one warm-up, each waited for on the device."""
    fn()
    backend.synchronize()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        backend.synchronize()
        times.append(time.perf_counter() - t0)
    return round(sorted(times)[len(times) // 2] * 1e3, 4)
