"""afd.cluster.forkserver: a node forked from the server is the process `python -m MODULE ARGS` would be.

tests/forkserver_probe.py reports what a node could observe of how it was started; the same command run as
a plain process is the reference."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_helpers import ROOT

from afd.cluster import forkserver
from afd.cluster.processes import Command, NodeProcesses, node_command

PROBE = "tests.forkserver_probe"
"""Run from the repository's root with this process's environment but AFD_*: the server that this worker's
clusters fork from forks it too."""


def _env(**extra) -> dict:
    return {**os.environ, "AFD_PROBE": "from-the-command", **extra}


def _fork(out: Path, *args: str, **env) -> forkserver.ForkedProcess:
    with open(out, "w") as fh:
        child = forkserver.fork_node([sys.executable, "-m", PROBE, *args], _env(**env), str(ROOT), fh.fileno())
    assert child is not None, "the fork server refused to fork the probe"
    return child


def _plain(*args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", PROBE, *args],
        env=_env(**env),
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        start_new_session=True,
        timeout=60,
    )


def test_a_forked_node_is_what_python_m_would_start(tmp_path):
    child = _fork(tmp_path / "out", "facts", "--node", "x")
    assert child.wait(60) == 0
    forked = (tmp_path / "out").read_text().splitlines()
    plain = _plain("facts", "--node", "x")
    assert plain.returncode == 0, plain.stderr
    facts, want = json.loads(forked[0]), json.loads(plain.stdout.splitlines()[0])
    # ps and pkill -f see the node's command, not the server's
    assert facts.pop("cmdline") == [sys.executable, "-m", PROBE, "facts", "--node", "x"]
    want.pop("cmdline")
    assert facts == want
    assert facts["argv"][1:] == ["facts", "--node", "x"] and facts["name"] == "__main__" and facts["leader"]
    assert forked[1:] == ["non-daemon thread joined at exit"] == plain.stdout.splitlines()[1:]


def test_exit_codes_are_a_processs(tmp_path):
    assert _fork(tmp_path / "a", "exit", "3").wait(60) == 3
    assert _fork(tmp_path / "b", "raise").wait(60) == 1
    assert "RuntimeError: probe failed on purpose" in (tmp_path / "b").read_text()
    sleeper = _fork(tmp_path / "c", "sleep")
    deadline = time.monotonic() + 60
    while "sleeping" not in (tmp_path / "c").read_text():
        assert time.monotonic() < deadline and sleeper.poll() is None
        time.sleep(0.05)
    os.killpg(sleeper.pid, signal.SIGKILL)  # the launcher's kill of a node's session
    assert sleeper.wait(10) == -signal.SIGKILL and sleeper.poll() == -signal.SIGKILL
    still = _fork(tmp_path / "d", "sleep")
    with pytest.raises(subprocess.TimeoutExpired):
        still.wait(0.2)
    still.terminate()
    assert still.wait(10) == -signal.SIGTERM


def test_an_environment_a_library_reads_at_import_gets_a_server_of_its_own(tmp_path):
    """OMP_NUM_THREADS is read when libgomp loads, in the server's preload: a command with another value
    must not be forked from a server that loaded it with this one."""
    omp = "1" if os.environ.get("OMP_NUM_THREADS") != "1" else "2"
    base = _fork(tmp_path / "a", "facts")
    first = forkserver._servers[forkserver._key(_env(), str(ROOT))]
    other = _fork(tmp_path / "b", "facts", OMP_NUM_THREADS=omp)
    second = forkserver._servers[forkserver._key(_env(OMP_NUM_THREADS=omp), str(ROOT))]
    assert first is not second and first.proc.pid != second.proc.pid
    assert base.wait(60) == 0 and other.wait(60) == 0
    assert json.loads((tmp_path / "b").read_text().splitlines()[0])["omp"] == omp


def test_the_launcher_forks_node_commands_only_and_can_be_told_not_to(tmp_path):
    cfg = tmp_path / "none.yaml"  # the node fails on it at once: what matters is how it was started
    cfg.write_text("cluster: {}\n")
    with NodeProcesses(str(tmp_path)) as procs:
        node = procs.start(node_command(str(cfg), "ffn", "ffn0"))
        other = procs.start(Command("tool", (sys.executable, "-c", "pass")))
        plain = NodeProcesses(str(tmp_path / "plain"), env={**os.environ, "AFD_FORKSERVER": "0"})
        (tmp_path / "plain").mkdir()
        unforked = plain.start(node_command(str(cfg), "ffn", "ffn1"))
        assert isinstance(node, forkserver.ForkedProcess)
        assert isinstance(other, subprocess.Popen) and isinstance(unforked, subprocess.Popen)
        assert node.wait(60) != 0 and unforked.wait(60) == node.returncode
        assert "model: required key is missing" in procs.log("ffn0") and procs.log("ffn0") == plain.log("ffn1")
        other.wait(60)
        plain.stop()


_C_CODE = """
import json, sys
print(json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0]}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def test_python_c_is_what_python_c_would_start():
    """`python -c CODE ARGS`, as tests/forked_python.py runs the suite's helpers: argv, `__main__`, sys.path's
    first entry, stdout and stderr apart, the exit code."""
    import forked_python

    argv = [sys.executable, "-c", _C_CODE, "4", "x"]
    forked = forked_python.run(argv, cwd=ROOT, timeout=60)
    plain = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert forked.returncode == plain.returncode == 4
    assert (
        json.loads(forked.stdout)
        == json.loads(plain.stdout)
        == {"argv": ["-c", "4", "x"], "name": "__main__", "path0": ""}
    )
    assert forked.stderr == plain.stderr == "to stderr\n"
    assert forkserver._servers, "it ran as a plain process: nothing was forked"
