"""The one place that starts and stops node processes on this host.

`afd launch`, `afd serve`, the local clusters of offline jobs (afd.cluster.local) and the tests all
start their processes through `NodeProcesses`: each in its own session, its output in a log file (and,
when echoing, on this process's stdout behind a `[name]` prefix), every wait with a deadline that also
watches for a process that died (its log tail is in the error). `stop` goes in stages — attention
nodes' rank 0 first (they drain and leave the data plane), then their other TP ranks, which follow rank
0 out, then the FFN nodes, which stop once every attention node has left — each stage SIGTERM, a grace
period, then SIGKILL of the whole session: nothing is left behind. With a RestartPolicy
(afd.cluster.supervise), the waits also restart a process that failed, with its own command.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from afd.cluster.forkserver import ForkedProcess, fork_node
from afd.cluster.host import descendants, free_ports, healthy, ports_in_use  # noqa: F401 (re-exported for tests, tools)
from afd.cluster.supervise import GiveUp, RestartPolicy, Supervisor

MODULES = {"attention": "attention_node.main", "ffn": "ffn_node.main"}
STAGES = ("attention", "tp", "ffn", "process")
"""Stop order. "tp": an attention node's ranks > 0; "process": anything else (e.g. an `afd serve`)."""


class ClusterError(RuntimeError):
    """A process of a cluster failed, or the cluster missed a deadline."""


class NodeExited(ClusterError):
    """A process exited (that should not have); the message ends with its log tail."""

    def __init__(self, name: str, code: int | None, tail: str, why: str | None = None):
        self.name, self.code = name, code
        self.why = why or f"node {name} exited with code {code}"
        """What happened, in one line (the message without the log tail)."""
        super().__init__(f"{self.why}; its log ends:\n{tail}")


@dataclass(frozen=True)
class Command:
    name: str
    """How the logs and errors call it: the process name (`attn0`, `attn0.tp1`, `ffn0`)."""
    argv: tuple[str, ...]
    stage: str = "process"
    ports: tuple[int, ...] = ()
    """The ports it listens on: its restart waits until they are free."""
    unit: str = ""
    """The processes that fail and restart together (a node's TP ranks: its name); default: its own name."""

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"stage: expected one of {', '.join(STAGES)}, got {self.stage!r}")


def node_command(
    config: str,
    role: str,
    node: str,
    tp_rank: int = 0,
    args: Iterable[str] = (),
    mode: str | None = None,
    prefix=(),
    ports: Iterable[int] = (),
) -> Command:
    """A node process of cluster YAML `config`: `mode` is a subcommand (`generate`), `prefix` what runs it
    (e.g. `ip netns exec NS`), `ports` those it listens on."""
    argv = [*prefix, sys.executable, "-m", MODULES[role], *([mode] if mode else []), "--config", str(config)]
    argv += ["--node", node] + (["--tp-rank", str(tp_rank)] if tp_rank else []) + list(args)
    stage = "tp" if tp_rank else role
    return Command(f"{node}.tp{tp_rank}" if tp_rank else node, tuple(argv), stage, tuple(ports), node)


@dataclass
class _Proc:
    command: Command
    popen: subprocess.Popen | ForkedProcess
    log: str


class NodeProcesses:
    """Processes started together and stopped together (`with` stops them). log_dir: where each
    process's log goes (a private temporary directory by default, removed by `stop`); echo: also copy
    every line to stdout behind its name; restart: restart a process that fails, while a wait watches them
    (afd.cluster.supervise; None: a failure is an error at once)."""

    def __init__(
        self,
        log_dir: str | None = None,
        env: dict | None = None,
        echo: bool = False,
        cwd=None,
        restart: RestartPolicy | None = None,
    ):
        self._tmp = None if log_dir else tempfile.TemporaryDirectory(prefix="afd-logs-")
        self.log_dir: str = self._tmp.name if self._tmp is not None else str(log_dir)
        self.env, self.echo, self.cwd = env, echo, cwd
        self.procs: dict[str, _Proc] = {}
        self._lock = threading.Lock()
        self._width = 0
        self.supervisor = Supervisor(restart, self.note) if restart is not None else None

    def __enter__(self) -> NodeProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- starting ---------------------------------------------------------------------------------

    def start(
        self, command: Command, env: dict | None = None, log: str | None = None, append: bool = False
    ) -> subprocess.Popen | ForkedProcess:
        """Starts `command` (a name already running here is refused); env: added to the launcher's; append:
        to its log (a restart) rather than a fresh one."""
        old = self.procs.get(command.name)
        if old is not None and old.popen.poll() is None:
            raise ValueError(f"{command.name} is already running (pid {old.popen.pid})")
        log = log or os.path.join(self.log_dir, f"{command.name}.log")
        full_env = {**(self.env if self.env is not None else os.environ), **(env or {})}
        with open(log, "a" if append else "w") as fh:
            p = self._forked(command, full_env, fh) or subprocess.Popen(
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
        if self.supervisor is not None:
            self.supervisor.started(command.unit or command.name, command.name)
        if self.echo:
            self._width = max(self._width, len(command.name))
            threading.Thread(target=self._pump, args=(command.name, p, log), daemon=True).start()
        return p

    def _forked(self, command: Command, env: dict, fh) -> ForkedProcess | None:
        """A node's process forked from afd.cluster.forkserver (its imports already paid), or None: not a node,
        or the fork server cannot fork it."""
        argv = list(command.argv)
        if len(argv) < 3 or argv[1] != "-m" or argv[2] not in MODULES.values():
            return None
        if not self.echo:
            return fork_node(argv, env, self.cwd, fh.fileno())
        r, w = os.pipe()
        try:
            child = fork_node(argv, env, self.cwd, w)
        finally:
            os.close(w)
        if child is None:
            os.close(r)
            return None
        child.stdout = open(r, errors="replace", buffering=1)  # noqa: SIM115 (the pump reads it to the end)
        return child

    def start_all(self, commands: Iterable[Command]) -> None:
        commands = list(commands)
        self._width = max([self._width, *(len(c.name) for c in commands)])  # one column for every prefix
        for c in commands:
            self.start(c)

    def _pump(self, name: str, p: subprocess.Popen | ForkedProcess, log: str) -> None:
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

    def note(self, line: str) -> None:
        """What the launcher has to say (a restart): on stdout when echoing, else in the log (afd.cluster)."""
        if self.echo:
            self.say(line)
        else:
            logging.getLogger("afd.cluster").warning("%s", line)

    # ---- watching ---------------------------------------------------------------------------------

    def popen(self, name: str) -> subprocess.Popen | ForkedProcess:
        return self.procs[name].popen

    def log(self, name: str) -> str:
        with open(self.procs[name].log, errors="replace") as fh:
            return fh.read()

    def tail(self, name: str, n: int = 15) -> str:
        return "".join(self.log(name).splitlines(keepends=True)[-n:])

    def check(self, exited_ok: bool = False) -> None:
        """Raises ClusterError naming the first process that exited (with a non-zero code only, when
        `exited_ok`: a job's processes finish), with its log tail. Under a restart policy a process that
        failed is restarted instead (after its back-off), until the policy gives up."""
        sup = self.supervisor
        for name, p in list(self.procs.items()):
            rc = p.popen.poll()
            if rc == 0 and exited_ok and sup is not None and sup.left(name):
                self.note(f"node {name} exited with code 0 (it was asked to stop); not restarting it")
            if rc is None or (exited_ok and rc == 0) or (sup is not None and sup.pending(p.command.unit or name)):
                continue
            if sup is None or rc == 0:
                raise NodeExited(name, rc, self.tail(name))
            key = p.command.unit or name
            for q in self._unit(name):  # what it left behind holds its ports; its unit (TP ranks) cannot go on
                _kill_session(q.popen)
            why = f"exited with code {rc}" if key == name else f"lost its process {name}, which exited with code {rc}"
            try:
                sup.failed(key, why)
            except GiveUp as e:
                raise NodeExited(name, rc, self.tail(name), str(e)) from None
        if sup is None:
            return
        for key in sup.due():
            unit = self._unit(key)
            try:
                if not sup.ports_ready(key, tuple(port for q in unit for port in q.command.ports)):
                    continue
            except GiveUp as e:
                raise NodeExited(key, unit[0].popen.returncode, self.tail(unit[0].command.name), str(e)) from None
            env = sup.restarting(key)
            pids = [str(self.start(q.command, env=env, log=q.log, append=True).pid) for q in unit]
            self.note(f"restarted {key} (pid {', '.join(pids)}; restart {sup.restarts(key)} of it since the launch)")

    def _unit(self, name: str) -> list[_Proc]:
        """The processes that restart with `name` (or those of unit `name`), in start order."""
        unit = self.procs[name].command.unit or name if name in self.procs else name
        return [p for p in self.procs.values() if (p.command.unit or p.command.name) == unit]

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
        """Every process exits with 0 within `timeout` s, or ClusterError. Their end: none is restarted."""
        self.supervisor = None
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


def _kill_session(p: subprocess.Popen | ForkedProcess) -> None:
    """SIGKILL to the process's whole session (what it started too), while its pid is still its own."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()
