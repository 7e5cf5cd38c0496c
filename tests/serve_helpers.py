"""`afd serve` run as a user runs it: a process group, its stdout in a file, the URLs it prints."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from cluster_helpers import ROOT, health


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
    def __init__(self, argv: list[str], log: Path, urls: list[str], env: dict | None = None):
        self.log, self.urls = log, urls
        with open(log, "w") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "afd.cli", "serve", *argv],
                stdout=fh,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )

    def wait_ready(self, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"afd serve exited with {self.proc.returncode}:\n{self.log.read_text()}")
            if all(health(u) == 200 for u in self.urls):
                return
            time.sleep(0.3)
        raise AssertionError(f"afd serve not ready:\n{self.log.read_text()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"afd serve ignored SIGTERM:\n{self.log.read_text()}") from None
