"""`afd serve` run as a user runs it: a process group, its stdout in a file, the URLs it prints."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from cluster_helpers import ROOT, health

from afd.cluster.processes import ClusterError, Command, NodeProcesses


def free_port_run(n: int) -> int:
    """A port P with P..P+n-1 all free (attention node i of `afd serve --port P` takes P + i)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


class Served:
    """`afd serve ARGV`, started and stopped by afd's launcher (afd.cluster.processes) as one process."""

    def __init__(self, argv: list[str], log: Path, urls: list[str], env: dict | None = None, tls=None):
        """tls: the ssl.SSLContext for https URLs."""
        self.log, self.urls, self.tls = log, urls, tls
        self.processes = NodeProcesses(str(log.parent), env={**os.environ, **(env or {})}, cwd=ROOT)
        self.proc = self.processes.start(
            Command("afd-serve", (sys.executable, "-m", "afd", "serve", *argv)), log=str(log)
        )

    def wait_ready(self, timeout: float = 120) -> None:
        def ready() -> bool:
            return all(health(u, self.tls) == 200 for u in self.urls)

        try:
            self.processes.wait_until(ready, timeout, "afd serve to be ready")
        except ClusterError as e:
            raise AssertionError(f"{e}\n{self.log.read_text()}") from None

    def stop(self) -> int:
        if self.processes.stop(60.0):
            raise AssertionError(f"afd serve ignored SIGTERM:\n{self.log.read_text()}")
        return self.proc.returncode
