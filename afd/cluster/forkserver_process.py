"""The fork server's own process (afd/cluster/forkserver.py starts it, `python -m afd.cluster.forkserver_process FD
ROOM`): it imports what every node imports once (`PRELOAD`), then forks a node per request on its socket, reaps
each and reports its exit code, and turns each child into the process `python -m MODULE ARGS` (or `python -c CODE
ARGS`) would be.

It imports nothing of afd beyond this module: afd reads AFD_* variables at import, which differ by node.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import socket
import sys
import threading
import time

PRELOAD = (
    "torch",
    "numpy",
    "transformers",
    "safetensors",
    "tokenizers",
    "fastapi",
    "uvicorn",
    "pydantic",
    "yaml",
    "google.protobuf",
    "prometheus_client",
)
"""What every node imports, and no module of afd: afd reads AFD_* variables at import."""
IDLE_S = 300.0
"""With no node alive and no request this long, the server leaves (a launcher starts another when it needs one)."""
MSG_BYTES = 1 << 20
"""The largest message on the socket (a request carries a node's environment)."""


def _usable() -> bool:
    import torch

    cuda = getattr(torch, "cuda", None)
    initialised = cuda is not None and cuda.is_initialized()
    return threading.active_count() == 1 and not initialised and "torch_npu" not in sys.modules


def serve(sock: socket.socket):
    """Forks a node per request until the launcher's end closes (or IDLE_S pass with nothing to do). Returns
    only in a forked child, with its request and its output's fds (stdout, and stderr where it has its own)."""
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            __import__(name)
    usable = _usable()
    gc.freeze()  # what the preload made outlives every fork: a child's collections neither scan nor write it
    sock.send(json.dumps({"ready": usable}).encode())
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    live: set[int] = set()
    idle_since = time.monotonic()
    closed = False  # the launcher asked for no more forks (or is gone): leave once the last node is reaped
    while not (closed and not live):
        watched: list = [wake_r] if closed else [sock, wake_r]
        ready, _, _ = select.select(watched, [], [], 5.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        for pid, status in _reaped():
            live.discard(pid)
            with contextlib.suppress(OSError):  # a launcher that is gone hears nothing
                sock.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
        if sock in ready:
            data, fds, _, _ = socket.recv_fds(sock, MSG_BYTES, 2)
            if not data:
                closed = True
                continue
            request = json.loads(data)
            pid = _fork(request, fds, usable, [sock.fileno(), wake_r, wake_w])
            if pid == 0:
                sock.detach()  # _fork closed its fd, which the child may reuse
                return request, fds
            for fd in fds:
                os.close(fd)
            if pid is not None:
                live.add(pid)
            sock.send(json.dumps({"id": request["id"], "pid": pid}).encode())
        if live or sock in ready:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > IDLE_S:
            return None
    return None


def _reaped():
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, status


def _fork(request: dict, fds: list[int], usable: bool, close: list[int]) -> int | None:
    """The child's pid once it leads its own session (0 in the child); None when it cannot fork."""
    if not usable or len(fds) not in (1, 2):
        return None
    sync_r, sync_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(sync_r)
        os.setsid()  # before the launcher hears its pid: a kill of its session must find it
        signal.set_wakeup_fd(-1)
        for fd in close:
            os.close(fd)
        os.close(sync_w)
        return 0
    os.close(sync_w)
    os.read(sync_r, 1)  # EOF once the child has its session
    os.close(sync_r)
    return pid


def become(request: dict, out_fds: list[int]) -> None:
    """In the forked child: turn into `python -m module args` (or `python -c code args`), then run it as `-m`
    (or `-c`) would. out_fds: stdout, and stderr where it is not stdout."""
    import runpy
    import types

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.dup2(out_fds[0], 1)
    os.dup2(out_fds[-1], 2)
    for fd in set(out_fds):
        os.close(fd)
    os.environ.clear()  # every variable unset and set again: none points into the block _set_area rewrites
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    _set_area(48, request["title"])  # /proc/PID/cmdline: arg_start, arg_end are stat fields 48, 49
    _set_area(50, [f"{k}={v}" for k, v in request["env"].items()])  # /proc/PID/environ: env_start, env_end: 50, 51
    main = sys.modules["__main__"] = types.ModuleType("__main__")
    if "code" in request:
        sys.argv = ["-c", *request["args"]]
        sys.path[0] = ""  # -c's first entry: the working directory, as it changes (-m's is its path at start)
        main.__dict__["__builtins__"] = __builtins__
        exec(compile(request["code"], "<string>", "exec"), main.__dict__)
        return
    sys.argv = ["-m", *request["args"]]
    runpy._run_module_as_main(request["module"], alter_argv=True)  # type: ignore[attr-defined]  # python -m's own


def _set_area(field: int, strings: list[str]) -> None:
    """Writes `strings`, NUL-terminated, over the memory area whose bounds are /proc/self/stat's fields `field` and
    `field + 1` (numbered from 1, as proc(5) does), the rest NUL: the argument area (what /proc/PID/cmdline
    reads) or the environment block (/proc/PID/environ). Left as it was where they do not fit."""
    import ctypes

    with open("/proc/self/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()  # from field 3 on: the name (field 2) may hold spaces
    start, end = int(fields[field - 3]), int(fields[field - 2])
    data = "".join(f"{s}\0" for s in strings).encode()
    if len(data) <= end - start:
        ctypes.memmove(start, data.ljust(end - start, b"\0"), end - start)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher stops it by closing its socket
    got = serve(socket.socket(fileno=int(sys.argv[1])))
    if got is not None:
        become(*got)
