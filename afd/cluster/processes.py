"""The one place that starts and stops node processes on this host.

`afd launch`, `afd serve`, the local clusters of offline jobs (afd.cluster.local) and the tests all
start their processes through `NodeProcesses`: each in its own session, its output in a log file (and,
when echoing, on this process's stdout behind a `[name]` prefix), every wait with a deadline that also
watches for a process that died (its log tail is in the error). `stop` goes in stages — attention
nodes' rank 0 first (they drain and leave the data plane), then their other TP ranks, which follow rank
0 out, then the FFN nodes, which stop once every attention node has left — each stage SIGTERM, a grace
period, then SIGKILL of the whole session: nothing is left behind.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass

MODULES = {"attention": "attention_node.main", "ffn": "ffn_node.main"}
STAGES = ("attention", "tp", "ffn", "process")
"""Stop order. "tp": an attention node's ranks > 0; "process": anything else (e.g. an `afd serve`)."""


class ClusterError(RuntimeError):
    """A process of a cluster failed, or the cluster missed a deadline."""


class NodeExited(ClusterError):
    """A process exited (that should not have); the message ends with its log tail."""

    def __init__(self, name: str, code: int, tail: str):
        super().__init__(f"node {name} exited with code {code}; its log ends:\n{tail}")
        self.name, self.code = name, code


@dataclass(frozen=True)
class Command:
    name: str
    """How the logs and errors call it: the process name (`attn0`, `attn0.tp1`, `ffn0`)."""
    argv: tuple[str, ...]
    stage: str = "process"

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"stage: expected one of {', '.join(STAGES)}, got {self.stage!r}")


def node_command(
    config: str, role: str, node: str, tp_rank: int = 0, args: Iterable[str] = (), mode: str | None = None, prefix=()
) -> Command:
    """A node process of cluster YAML `config`: `mode` is a subcommand (`generate`), `prefix` what runs it
    (e.g. `ip netns exec NS`)."""
    argv = [*prefix, sys.executable, "-m", MODULES[role], *([mode] if mode else []), "--config", str(config)]
    argv += ["--node", node] + (["--tp-rank", str(tp_rank)] if tp_rank else []) + list(args)
    stage = "tp" if tp_rank else role
    return Command(f"{node}.tp{tp_rank}" if tp_rank else node, tuple(argv), stage)


@dataclass
class _Proc:
    command: Command
    popen: subprocess.Popen
    log: str


class NodeProcesses:
    """Processes started together and stopped together (`with` stops them). log_dir: where each
    process's log goes (a private temporary directory by default, removed by `stop`); echo: also copy
    every line to stdout behind its name."""

    def __init__(self, log_dir: str | None = None, env: dict | None = None, echo: bool = False, cwd=None):
        self._tmp = None if log_dir else tempfile.TemporaryDirectory(prefix="afd-logs-")
        self.log_dir: str = self._tmp.name if self._tmp is not None else str(log_dir)
        self.env, self.echo, self.cwd = env, echo, cwd
        self.procs: dict[str, _Proc] = {}
        self._lock = threading.Lock()
        self._width = 0

    def __enter__(self) -> NodeProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- starting ---------------------------------------------------------------------------------

    def start(self, command: Command, env: dict | None = None, log: str | None = None) -> subprocess.Popen:
        """Starts `command` (a name already running here is refused); env: added to the launcher's."""
        old = self.procs.get(command.name)
        if old is not None and old.popen.poll() is None:
            raise ValueError(f"{command.name} is already running (pid {old.popen.pid})")
        log = log or os.path.join(self.log_dir, f"{command.name}.log")
        full_env = {**(self.env if self.env is not None else os.environ), **(env or {})}
        with open(log, "w") as fh:
            p = subprocess.Popen(
                list(command.argv),
                stdout=subprocess.PIPE if self.echo else fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a terminal's Ctrl-C reaches the launcher only; it stops them in order
                env=full_env,
                cwd=self.cwd,
                text=self.echo,
                bufsize=1 if self.echo else -1,  # echoed: line by line
            )
        self.procs[command.name] = _Proc(command, p, log)
        if self.echo:
            self._width = max(self._width, len(command.name))
            threading.Thread(target=self._pump, args=(command.name, p, log), daemon=True).start()
        return p

    def start_all(self, commands: Iterable[Command]) -> None:
        commands = list(commands)
        self._width = max([self._width, *(len(c.name) for c in commands)])  # one column for every prefix
        for c in commands:
            self.start(c)

    def _pump(self, name: str, p: subprocess.Popen, log: str) -> None:
        assert p.stdout is not None  # a pipe when echoing
        with open(log, "a") as fh:
            for line in p.stdout:
                fh.write(line)
                fh.flush()
                self.say(line, prefix=name)

    def say(self, line: str, prefix: str = "launch") -> None:
        """One line on stdout behind a prefix, never interleaved with a node's."""
        with self._lock:
            sys.stdout.write(f"[{prefix:<{self._width}}] {line.rstrip(chr(10))}\n")
            sys.stdout.flush()

    # ---- watching ---------------------------------------------------------------------------------

    def popen(self, name: str) -> subprocess.Popen:
        return self.procs[name].popen

    def log(self, name: str) -> str:
        with open(self.procs[name].log, errors="replace") as fh:
            return fh.read()

    def tail(self, name: str, n: int = 15) -> str:
        return "".join(self.log(name).splitlines(keepends=True)[-n:])

    def check(self, exited_ok: bool = False) -> None:
        """Raises ClusterError naming the first process that exited (with a non-zero code only, when
        `exited_ok`: a job's processes finish), with its log tail."""
        for name, p in self.procs.items():
            rc = p.popen.poll()
            if rc is not None and not (exited_ok and rc == 0):
                raise NodeExited(name, rc, self.tail(name))

    def wait_until(
        self,
        ready: Callable[[], bool],
        timeout: float | None,
        what: str,
        stopping: Callable[[], bool] = lambda: False,
        exited_ok: bool = False,
        every: float = 0.05,
    ) -> bool:
        """Polls `ready` until it holds (True) or `stopping` does (False); raises ClusterError when a
        process dies first or `timeout` seconds pass (None: no deadline, for a launcher that runs until
        it is signalled)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not stopping():
            self.check(exited_ok)
            if ready():
                return True
            if deadline is not None and time.monotonic() > deadline:
                raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(every)
        return False

    def wait_exit(self, timeout: float, what: str = "the cluster's processes") -> None:
        """Every process exits with 0 within `timeout` s, or ClusterError."""
        self.wait_until(
            lambda: all(p.popen.poll() == 0 for p in self.procs.values()), timeout, f"{what} to exit", exited_ok=True
        )

    # ---- stopping ---------------------------------------------------------------------------------

    def stop(self, grace: dict[str, float] | float = 10.0, names: Iterable[str] | None = None) -> list[str]:
        """Stops the processes (or those `names`) stage by stage; returns the names that had to be killed."""
        chosen = [self.procs[n] for n in names] if names is not None else list(self.procs.values())
        killed = []
        for stage in STAGES:
            group = [p for p in chosen if p.command.stage == stage]
            for p in group:
                if p.popen.poll() is None:
                    p.popen.send_signal(signal.SIGTERM)
            wait = grace.get(stage, 10.0) if isinstance(grace, dict) else grace
            end = time.monotonic() + wait
            for p in group:
                try:
                    p.popen.wait(max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    killed.append(p.command.name)
                    if self.echo:
                        self.say(f"{p.command.name} (pid {p.popen.pid}) did not stop in {wait:.0f}s; killing it")
                    _kill_session(p.popen)
        if names is None and self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        return killed


def _kill_session(p: subprocess.Popen) -> None:
    """SIGKILL to the process's whole session (what it started too), while its pid is still its own."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()


# ---- before starting, and readiness ------------------------------------------------------------------


def ports_in_use(cfg) -> list[str]:
    """The YAML's ports (of this host's nodes) that something already listens on."""
    busy = []
    for n in cfg.nodes:
        for name in ("control", "data", "http", "metrics"):
            port = getattr(n.ports, name)
            if port is None:
                continue
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is free
                try:
                    s.bind(("0.0.0.0", port))
                except OSError:
                    busy.append(f"{port} ({n.name}.ports.{name})")
    return busy


def healthy(url: str, context=None) -> bool:
    """`/health` answers 200 (`context`: the ssl.SSLContext of an https URL)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1, context=context) as r:
            return r.status == 200
    except OSError:
        return False


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports free on `host` now, for nodes that bind them seconds later. Chosen below the kernel's
    ephemeral range: a port the OS hands out (a bind to port 0, the source port of every outgoing connection)
    comes from that range, so one picked there can be taken by anything on the machine before the node
    binds it (seen under make test's parallel workers)."""
    top = _ephemeral_low()
    pick = random.SystemRandom()
    ports: list[int] = []
    while len(ports) < n:
        port = pick.randrange(10000, top) if top > 11000 else _os_port(host)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        ports.append(port)
    return ports


def _os_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(_read("/proc/sys/net/ipv4/ip_local_port_range").split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, grandchildren, ...), from /proc."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(_read(f"/proc/{d}/stat").rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()
