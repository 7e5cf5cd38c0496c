"""Node processes forked from a process that has already imported what every node imports.

A node process pays about 2.5 s of CPU before it does any work: the interpreter, `import torch` (1.1-1.7 s),
transformers (0.8 s) and fastapi (0.4 s). A launcher that starts a cluster's nodes on one host (and restarts
them) pays that once per node; the test suite, which starts about 200 nodes, paid most of its time there. So
`NodeProcesses` starts a node through a fork server when it can: one process per launcher that imports those
libraries once and forks each node from itself (forkserver_process.py, the server's own module), as
`multiprocessing`'s forkserver does and as PyTorch's own DataLoader workers fork after `import torch`.

A forked node is the process `python -m MODULE ARGS` would be:
- its environment, working directory, `sys.argv` and `__main__` are the command's; it runs the module as `-m`
  runs it (`runpy`), and exits as it would (atexit, non-daemon threads, a traceback and code 1);
- it is the leader of a session of its own, its stdout and stderr are the launcher's log file or pipe;
- `/proc/PID/cmdline` (ps, pkill -f) shows the node's command, written over the server's argument area (the
  server is started with room for it, as PostgreSQL and nginx title their processes).

What it cannot share is what a library read from the environment when the server imported it (OMP_NUM_THREADS
is read when libgomp loads, HF_HUB_OFFLINE when transformers does). A server therefore serves only commands
whose environment equals its own except for afd's own `AFD_*` variables (afd is not preloaded), and in its
working directory; another environment gets a server of its own. Nothing the server preloads touches a
device: a server whose preload initialised CUDA or loaded torch_npu (torch's device-backend autoload) or
started a Python thread says so, and the launcher starts nodes as plain processes instead. So does
`AFD_FORKSERVER=0`.

The server takes requests as long as the process that started it lives (its socket's end closes with that
process), and leaves once the nodes it forked have exited: it is their parent, and reaps them. It also leaves
after `IDLE_S` seconds with no node alive and no request, so that a program which ran `afd.LLM` with node
processes is not left holding a server it no longer uses; a launcher keeps one idle server at most.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading

from afd.cluster import forkserver_process
from afd.cluster.forkserver_process import MSG_BYTES

ROOM = 4096
"""Bytes of argument area the server starts with, that a node's command line is written into."""
ENV_ROOM = 16384
"""Bytes the server's environment block has beyond its own variables, that a node's environment is written into
(/proc/PID/environ reads that block, not what setenv changed since)."""
REPLY_S = 120.0
"""How long a launcher waits for a fork's pid: the first one waits for the preload (seconds on a busy host)."""
ENV_SWITCH = "AFD_FORKSERVER"


def enabled(env: dict) -> bool:
    return env.get(ENV_SWITCH, "1") != "0"


def _shared(name: str) -> bool:
    """Whether a variable may differ between a server and what it forks: afd's own (afd is not preloaded), and
    pytest's name of the running test, which changes with every test."""
    return not name.startswith("AFD_") and name != "PYTEST_CURRENT_TEST"


def _key(env: dict, cwd: str) -> tuple:
    return cwd, tuple(sorted((k, v) for k, v in env.items() if _shared(k)))


class ForkedProcess:
    """A node forked by the server, with the part of `subprocess.Popen`'s interface the launchers use. Its exit
    code comes from the server, which is its parent and reaps it."""

    def __init__(self, args, pid: int, stdout=None):
        self.args, self.pid, self.stdout = list(args), pid, stdout
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _set_exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"<ForkedProcess pid {self.pid} returncode {self.returncode}>"


class ForkServer:
    """One server process and the nodes it forked; `fork` is safe from any thread."""

    def __init__(self, env: dict, cwd: str):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", forkserver_process.__name__, str(theirs.fileno()), " " * ROOM],
            pass_fds=[theirs.fileno()],
            env={**env, "AFD_FORKSERVER_ROOM": " " * ENV_ROOM},
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=None,  # a preload that fails says why on the launcher's stderr
            start_new_session=True,  # a terminal's Ctrl-C reaches the launcher only, as for the nodes
        )
        theirs.close()
        self.sock = ours
        self.alive = True
        self.usable: bool | None = None
        """None until the server says whether its preload left it safe to fork."""
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._replies: dict[int, list] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._early: dict[int, int] = {}
        self._next = 0
        threading.Thread(target=self._read, name="afd-forkserver", daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                data = self.sock.recv(MSG_BYTES)
                if not data:
                    break
                msg = json.loads(data)
                if "ready" in msg:
                    self.usable = msg["ready"]
                    self._ready.set()
                elif "id" in msg:
                    slot = self._replies.get(msg["id"])
                    if slot is not None:
                        slot.append(msg.get("pid"))
                        slot[0].set()
                elif "exited" in msg:
                    with self._lock:
                        child = self._children.pop(msg["exited"], None)
                        if child is None:  # it exited before its fork's reply was read
                            self._early[msg["exited"]] = msg["code"]
                    if child is not None:
                        child._set_exit(msg["code"])
        except OSError:
            pass
        self._lost()

    def _lost(self) -> None:
        """The server is gone: its nodes' codes with it. Each is watched until it exits, then reported as 1."""
        self.alive = False
        self._ready.set()
        for slot in list(self._replies.values()):
            slot[0].set()
        with self._lock:
            orphans, self._children = list(self._children.values()), {}
        for child in orphans:
            threading.Thread(target=_watch_orphan, args=(child,), daemon=True).start()

    def fork(self, argv: list[str], env: dict, cwd: str, out_fds: list[int], stdout=None):
        """`argv` (`python -m MODULE ARGS` or `python -c CODE ARGS`), or None when this server cannot fork it (gone,
        or unsafe). out_fds: its stdout, and its stderr where that is another file."""
        if not self._ready.wait(REPLY_S) or not self.alive or not self.usable:
            return None
        done = threading.Event()
        with self._lock:
            self._next += 1
            rid = self._next
            self._replies[rid] = [done]
        what = "module" if argv[1] == "-m" else "code"
        request = {"id": rid, what: argv[2], "args": argv[3:], "env": env, "cwd": cwd, "title": argv}
        try:
            socket.send_fds(self.sock, [json.dumps(request).encode()], out_fds)
            done.wait(REPLY_S)
        except OSError:
            pass
        slot = self._replies.pop(rid)
        pid = slot[1] if len(slot) > 1 else None
        if pid is None:
            return None
        child = ForkedProcess(argv, pid, stdout)
        with self._lock:
            early = self._early.pop(pid, None)
            if early is None:
                self._children[pid] = child
        if early is not None:
            child._set_exit(early)
        return child

    @property
    def busy(self) -> bool:
        """Some node it forked is alive (its exit code is still to come from this server)."""
        return bool(self._children) or bool(self._replies)

    def close(self, timeout: float = 10.0) -> None:
        """No more forks. The server leaves once its last node has exited and been reaped (a node outlives
        the launcher as a plain process would); with none alive, this waits for it to go."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)
        if self.busy:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _watch_orphan(child: ForkedProcess) -> None:
    try:
        fd = os.pidfd_open(child.pid)
    except OSError:
        child._set_exit(1)
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)
    child._set_exit(1)


_servers: dict[tuple, ForkServer] = {}
_servers_lock = threading.Lock()


def fork_node(
    argv: list[str], env: dict, cwd: str | None, out_fd: int, stdout=None, err_fd: int | None = None
) -> ForkedProcess | None:
    """Forks `argv` (`python -m MODULE ARGS` or `python -c CODE ARGS` on this interpreter) from the server for its
    environment and working directory, started on first use; None when it cannot (then the caller starts it as a
    process). Its stdout is out_fd, its stderr err_fd (default: out_fd)."""
    if len(argv) < 3 or argv[0] != sys.executable or argv[1] not in ("-m", "-c") or not enabled(env):
        return None
    cwd = os.path.abspath(cwd or os.getcwd())
    if len(("\0".join(argv) + "\0").encode()) > ROOM:
        return None
    key = _key(env, cwd)
    for _ in range(2):  # a server that left on idle as this request came is replaced once
        idle: list[ForkServer] = []
        with _servers_lock:
            server = _servers.get(key)
            if server is None or not server.alive:
                idle = [_servers.pop(k) for k in [k for k, s in _servers.items() if not s.busy]]
                server = _servers[key] = ForkServer({k: v for k, v in env.items() if _shared(k)}, cwd)
        _close_idle(idle)  # outside the lock: each close waits for its server to leave
        child = server.fork(argv, env, cwd, [out_fd] if err_fd is None else [out_fd, err_fd], stdout)
        if child is not None or (server.alive and server.usable is False):
            return child
    return None


def _close_idle(servers) -> None:
    for server in servers:
        server.close()


@atexit.register
def close_all() -> None:
    with _servers_lock:
        servers = list(_servers.values())
        _servers.clear()
    _close_idle(servers)
