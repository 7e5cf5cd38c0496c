"""Processes that run a few lines of torch code each (the ranks of a torch.distributed test, a script on the
fake NPU), forked from a server that imported torch once: multiprocessing's forkserver, started by the first
use in a test process. A rank then starts in milliseconds instead of after torch's import (2 s of CPU on the
two-core machines here, a dozen times a run).

Each process is a real one (its own pid, sockets, threads and exit code); what it shares with the server is
only the import of torch. Its environment is the caller's at `run`, not the server's at its start, and
`tests/fakes` is imported in the rank itself, so every rank starts without the fake torch_npu.
"""

from __future__ import annotations

import dataclasses
import io
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_CONTEXT = None


def context():
    """The forkserver context, its server preloading torch (torch.distributed included)."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed"])
    return _CONTEXT


@dataclasses.dataclass
class Ran:
    returncode: int | None
    """None: still running at the deadline, then killed."""
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr + ("\n<timed out>" if self.returncode is None else "")


def _exec(code: str, argv: list[str], env: dict[str, str], out: str, err: str) -> None:
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    # line-buffered: a rank that ends with os._exit keeps what it printed
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    sys.argv = ["-c", *argv]
    exec(compile(code, "<rank>", "exec"), {"__name__": "__main__"})


def run(
    code: str,
    argvs: list[list[str]],
    timeout: float = 90,
    env: dict[str, str] | None = None,
    wait: list[int] | None = None,
) -> list[Ran]:
    """`code` as one process per argv (its sys.argv[1:]), all at once; each one's exit code and output once
    all have ended, or the deadline (from now) has passed and the rest were killed. env: the processes'
    whole environment (default: this process's). wait: only these processes are waited for; the others
    are killed once they have ended (a peer left hanging on purpose)."""
    ctx = context()
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory() as d:
        procs = []
        for i, argv in enumerate(argvs):
            out, err = os.path.join(d, f"{i}.out"), os.path.join(d, f"{i}.err")
            p = ctx.Process(target=_exec, args=(code, argv, env, out, err), daemon=True)
            p.start()
            procs.append((p, out, err))
        end = time.monotonic() + timeout
        for i, (p, _, _) in enumerate(procs):
            if wait is None or i in wait:
                p.join(max(0.0, end - time.monotonic()))
        ran = []
        for p, out, err in procs:
            code_ = p.exitcode
            if code_ is None:
                p.kill()
                p.join()
            read = [Path(f).read_text(errors="replace") if os.path.exists(f) else "" for f in (out, err)]
            ran.append(Ran(code_, *read))
    return ran


def run_ranks(
    code: str, ranks: int, timeout: float = 90, env: dict[str, str] | None = None, wait: list[int] | None = None
) -> list[Ran]:
    """`code` as `ranks` processes, sys.argv[1] being the rank."""
    return run(code, [[str(r)] for r in range(ranks)], timeout, env, wait)
