"""Start real clusters for end-to-end tests: a YAML with free ports, node processes, and teardown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from afd.cluster.processes import ClusterError, NodeProcesses, free_ports, node_command

ROOT = Path(__file__).resolve().parent.parent


def skip_unless_ci_installs(reason: str) -> None:
    """Skip for a missing tool that .ci/run installs; under CI=true that is a failure, so that CI never
    passes by skipping what it is meant to test."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


def cluster_yaml(tmp: Path, model_path: str, attention: int = 1, ffn: int = 1, name: str = "test", **sections) -> Path:
    """A cluster YAML on 127.0.0.1 with free ports; `sections` are merged into cluster/model/layout/engine."""
    ports = iter(free_ports(4 * (attention + ffn)))
    nodes = []
    for i in range(attention):
        nodes.append(
            {
                "name": f"attn{i}",
                "role": "attention",
                "host": "127.0.0.1",
                "ports": {"control": next(ports), "data": next(ports), "http": next(ports)},
            }
        )
    for i in range(ffn):
        nodes.append(
            {
                "name": f"ffn{i}",
                "role": "ffn",
                "host": "127.0.0.1",
                "ports": {"control": next(ports), "data": next(ports), "metrics": next(ports)},
            }
        )
    doc = {
        "cluster": {
            "name": name,
            "startup_timeout": 60,
            "heartbeat_interval": 0.5,
            "heartbeat_timeout": 5,
            "comm_timeout": 30,
        },
        "model": {"path": model_path, "dtype": "float32"},
        "engine": {"block_size": 4, "kv_cache_bytes": "16MiB", "shutdown_timeout": 10},
        "nodes": nodes,
    }
    for key, extra in sections.items():
        doc.setdefault(key, {}).update(extra)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class Cluster:
    """Node processes of one YAML, each started by its own command (as a user or systemd would), through
    afd's launcher (afd.cluster.processes)."""

    def __init__(self, config: Path, env: dict | None = None):
        self.config = config
        self.doc = yaml.safe_load(config.read_text())
        self.processes = NodeProcesses(str(config.parent), env={**os.environ, **(env or {})}, cwd=ROOT)
        self._started = 0

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return {name: p.popen for name, p in self.processes.procs.items()}

    def node(self, name: str) -> dict:
        return next(n for n in self.doc["nodes"] if n["name"] == name)

    def url(self, name: str = "attn0") -> str:
        scheme = "https" if (self.doc.get("http") or {}).get("ssl_certfile") else "http"
        return f"{scheme}://127.0.0.1:{self.node(name)['ports']['http']}"

    @property
    def tls(self):
        """The ssl.SSLContext afd's own clients use for this cluster's API (None: plain HTTP)."""
        from afd.cluster.api_client import client_context
        from afd.config.http_section import HttpSection

        return client_context(HttpSection(**(self.doc.get("http") or {})))

    def start(
        self, name: str, extra: list[str] | None = None, env: dict | None = None, tp_rank: int = 0
    ) -> subprocess.Popen:
        """Node `name` (its TP rank `tp_rank`, logged as `NODE.tpR`), on 127.0.0.1; a name started
        again (a replacement after a kill) gets a fresh log."""
        args = ["--bind-host", "127.0.0.1", *(extra or [])]
        cmd = node_command(str(self.config), self.node(name)["role"], name, tp_rank, args)
        self._started += 1
        log = self.config.parent / f"{self.config.stem}-{cmd.name}-{self._started}.log"
        return self.processes.start(cmd, env=env, log=str(log))

    def kill(self, name: str) -> None:
        """SIGKILL to node `name`, returning once it is reaped: its peers can see the death (its sockets
        close during exit) a moment before the process is gone, and a replacement started in that moment
        would be refused as already running."""
        popen = self.procs[name]
        popen.send_signal(signal.SIGKILL)
        popen.wait(10)

    def start_all(self, reverse: bool = True) -> None:
        """Every node, and an attention node's TP ranks (layout.attention_tp) after it."""
        names = [n["name"] for n in self.doc["nodes"]]
        tp = (self.doc.get("layout") or {}).get("attention_tp", 1)
        for name in reversed(names) if reverse else names:
            self.start(name)
            if self.node(name)["role"] == "attention":
                for r in range(1, tp):
                    self.start(name, tp_rank=r)

    def log(self, name: str) -> str:
        return self.processes.log(name)

    def wait_ready(self, timeout: float = 90.0) -> None:
        urls = [self.url(n["name"]) for n in self.doc["nodes"] if n["role"] == "attention"]
        try:
            self.processes.wait_until(
                lambda: all(health(u, self.tls) == 200 for u in urls), timeout, "the cluster to be ready", every=0.2
            )
        except ClusterError as e:
            logs = "\n".join(f"--- {n}\n{self.log(n)}" for n in self.processes.procs)
            raise AssertionError(f"{e}\n{logs}") from None

    def stop(self) -> None:
        self.processes.stop(15.0)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def health(url: str, context=None) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2, context=context) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def post(url: str, path: str, body, headers: dict | None = None, timeout: float = 60, context=None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url + path, data=data, method="POST", headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def get(url: str, path: str, timeout: float = 10) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url + path, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_for(what: str, fn, timeout: float, log: Path | None = None):
    """Polls fn() until it is truthy (an OSError counts as not yet); the AssertionError names `what`."""
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        try:
            last = fn()
        except OSError as e:  # not listening yet
            last = e
        else:
            if last:
                return last
        time.sleep(0.25)
    extra = f"\n--- prometheus log\n{log.read_text()[-4000:]}" if log else ""
    raise AssertionError(f"timed out waiting for {what}; last: {last}{extra}")


class LLMPool:
    """afd.LLMs by their arguments, built once and shared by the tests that run the same configuration:
    a multi-process LLM keeps its node processes across generate() calls, so each configuration starts
    its cluster once. At most `max_live` clusters run at a time (the least recently used one is closed,
    and started again by its next generate()); `close` stops them all."""

    def __init__(self, max_live: int = 2):
        self.max_live = max_live
        self._llms: dict = {}

    def get(self, model: str, **kwargs):
        import afd

        key = (model, tuple(sorted(kwargs.items())))
        llm = self._llms.pop(key, None) or afd.LLM(model, **kwargs)
        self._llms[key] = llm  # the most recently used last
        live = [other for other in self._llms.values() if other is not llm and other._local is not None]
        for other in live[: max(0, len(live) - (self.max_live - 1))]:  # room for this one's cluster
            other.close()
        return llm

    def close(self) -> None:
        for llm in self._llms.values():
            llm.close()
        self._llms.clear()


def stop_launcher(launcher, procs) -> None:
    """The end of a test of `afd launch` (launcher: its process in `procs`): a launcher still running (an
    assertion failed) has its nodes killed, not left running; then `procs` stop."""
    import contextlib

    from afd.cluster.processes import descendants

    if launcher.poll() is None:
        for pid in descendants(launcher.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    procs.stop()
