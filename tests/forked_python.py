"""`subprocess.run([sys.executable, "-c" or "-m", ...])` for a test, forked from afd's fork server where it can be.

A fresh interpreter that imports torch pays about 2 s of CPU before its first line of work, and the suite runs
dozens of them (the README's code, the CLI's commands, a load's peak memory). Forked from the server this
worker's clusters already use (afd/cluster/forkserver.py), each is the same process as far as the test can tell:
its own argv, environment, working directory, `__main__`, stdout and stderr, exit code; only the libraries the
server preloads are already imported. So a test that asserts what a fresh interpreter imports (or that runs
with another environment, which would start a server of its own) uses subprocess.run instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from afd.cluster.forkserver import fork_node


def run(
    argv: list[str],
    *,
    timeout: float,
    cwd: str | os.PathLike | None = None,
    env: dict | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess:
    """subprocess.run(argv, capture_output=True, text=True, ...) for `python -c CODE ARGS` or `python -m MODULE ARGS`
    on this interpreter; a plain subprocess where the fork server cannot take it."""
    argv = [str(a) for a in argv]
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = fork_node(argv, env, None if cwd is None else str(cwd), out.fileno(), err_fd=err.fileno())
        if child is None:
            kw = {"cwd": cwd, "env": env, "timeout": timeout, "check": check}
            return subprocess.run(argv, capture_output=True, text=True, **kw)
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(10)
            raise
        out.seek(0)
        err.seek(0)
        r = subprocess.CompletedProcess(argv, code, _text(out.read()), _text(err.read()))
    if check:
        r.check_returncode()
    return r


def _text(data: bytes) -> str:
    return data.decode(sys.getdefaultencoding(), errors="replace").replace("\r\n", "\n")
