"""`afd launch` supervising its nodes, as a user meets it: a killed node is restarted by its own command
(logged, counted on its /metrics, the cluster serves again, SIGTERM still ends everything with 0), a node
that fails on every start makes the launcher give up after cluster.max_restarts, and the commands
`--print-commands` prints work as printed on another shell: the token in a 0600 file, never on a command
line."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cluster_helpers import ROOT, cluster_yaml, get, health, post, stop_launcher
from hf_reference import PROMPTS
from sse import Streams

from afd.cluster.processes import Command, NodeProcesses, descendants
from afd.cluster.token import TOKEN_ENV, TOKEN_FILE_ENV

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # each starts and restarts real nodes: > 10 s
NEW = 64
FAST = {"heartbeat_interval": 0.3, "heartbeat_timeout": 2, "rejoin_timeout": 60, "restart_backoff": 0.2}


def _env(tmp_path: Path) -> dict:
    """A fresh shell's environment: no token of its own, a runtime dir of its own (where token files go),
    this checkout's afd first on the path."""
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}
    run = tmp_path / "run"
    run.mkdir(mode=0o700, exist_ok=True)
    env["XDG_RUNTIME_DIR"] = str(run)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])  # afd-attention, afd-ffn
    return env


def _greedy(url: str, prompt, max_tokens: int = 8) -> list[int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    code, out = post(url, "/v1/completions", body)
    assert code == 200, out
    return out["choices"][0]["token_ids"]


def _node_pid(launcher_pid: int, node: str) -> int:
    for pid in descendants(launcher_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--node" in argv and argv[argv.index(b"--node") + 1].decode() == node:
            return pid
    raise AssertionError(f"no process of node {node} under the launcher")


def _restarts(url: str) -> float:
    text = get(url, "/metrics")[1].decode()
    m = re.search(r"^afd_node_restarts_total\{[^}]*\} (\S+)$", text, re.M)
    assert m, "afd_node_restarts_total is not exported"
    return float(m.group(1))


def _launch(procs: NodeProcesses, path: Path, env: dict):
    launcher = procs.start(Command("afd-launch", (sys.executable, "-m", "afd", "launch", str(path))), env=env)

    def url_line() -> list[str]:
        return [line for line in procs.log("afd-launch").splitlines() if line.startswith("http://")]

    procs.wait_until(url_line, 120, "afd launch to print its URL")
    return launcher, url_line()[0]


def _wait_log(procs: NodeProcesses, name: str, text: str, timeout: float) -> None:
    procs.wait_until(lambda: text in procs.log(name), timeout, f"{text!r} in the launcher's output", exited_ok=True)


def test_a_killed_ffn_node_is_restarted_counted_and_the_cluster_serves_again(tiny_checkpoint, tmp_path):
    """Under 16 greedy streams: every stream resumes on the restarted node and ends with the tokens it
    would have had."""
    path = cluster_yaml(tmp_path, tiny_checkpoint, 1, 1, name="supervised", cluster=FAST)
    doc = yaml.safe_load(path.read_text())
    ffn_metrics = f"http://127.0.0.1:{doc['nodes'][1]['ports']['metrics']}"
    env = _env(tmp_path)
    procs = NodeProcesses(str(tmp_path), cwd=ROOT)
    launcher, url = _launch(procs, path, env)
    try:
        before = [_greedy(url, p, NEW) for p in PROMPTS]
        token_path = str(
            Path(env["XDG_RUNTIME_DIR"]) / "afd-tokens" / f"supervised-{doc['nodes'][0]['ports']['control']}"
        )
        assert stat.S_IMODE(os.stat(token_path).st_mode) == 0o600
        token = Path(token_path).read_text().strip()
        ffn = _node_pid(launcher.pid, "ffn0")
        for pid in descendants(launcher.pid):  # the token is in no command line; the nodes are told the file
            assert token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert f"{TOKEN_FILE_ENV}={token_path}".encode() in Path(f"/proc/{ffn}/environ").read_bytes().split(b"\0")
        assert _restarts(ffn_metrics) == 0 and _restarts(url) == 0

        streams = Streams(url, PROMPTS * 4, {"max_tokens": NEW, "temperature": 0}, 180)
        assert streams.wait_started(60)
        os.kill(ffn, signal.SIGKILL)
        _wait_log(procs, "afd-launch", "node ffn0 exited with code -9; restarting it in 0.2s", 30)
        _wait_log(procs, "afd-launch", "restarted ffn0", 60)
        end = time.monotonic() + 90
        while health(url) != 200 or health(ffn_metrics) != 200:
            assert time.monotonic() < end, procs.log("afd-launch")[-4000:]
            time.sleep(0.2)
        assert _node_pid(launcher.pid, "ffn0") != ffn
        assert streams.join(180) == 0  # none hung
        assert streams.results == [(ids, []) for ids in before * 4]  # none failed, none changed
        resumed = re.findall(r"data plane re-formed; (\d+) request\(s\) resume", procs.log("afd-launch"))
        assert resumed and int(resumed[-1]) > 0, "no stream was in flight when the FFN node died"
        assert _greedy(url, PROMPTS[0], NEW) == before[0]  # a new request, on the replacement's experts
        assert _restarts(ffn_metrics) == 1 and _restarts(url) == 0

        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(90) == 0, procs.log("afd-launch")[-4000:]
        out = procs.log("afd-launch")
        assert "stopping the cluster" not in out and "Traceback" not in out, out[-4000:]
        assert not os.path.exists(token_path)  # the launcher made it, the launcher removes it
    finally:
        stop_launcher(launcher, procs)


def test_a_node_failing_on_every_start_makes_the_launcher_give_up(tiny_checkpoint, tmp_path):
    path = cluster_yaml(tmp_path, tiny_checkpoint, 1, 1, name="crashloop", cluster={**FAST, "max_restarts": 2})
    procs = NodeProcesses(str(tmp_path), cwd=ROOT)
    launcher, _ = _launch(procs, path, _env(tmp_path))
    try:
        children = descendants(launcher.pid)
        doc = yaml.safe_load(path.read_text())
        doc["model"]["dtype"] = "float8"  # someone broke the file: every new start of a node fails on it
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        os.kill(_node_pid(launcher.pid, "ffn0"), signal.SIGKILL)
        assert launcher.wait(120) == 1, procs.log("afd-launch")[-4000:]
        out = procs.log("afd-launch")
        assert "node ffn0 exited with code 2; restarting it in 0.4s (restart 2 of at most 2 in a row)" in out
        assert (
            "node ffn0 exited with code 2; 2 restarts in a row already (cluster.max_restarts: 2); giving up; "
            "stopping the cluster" in out
        ), out[-4000:]
        assert "model.dtype: expected auto, float32, bfloat16, float16" in out  # the node's own one line, each time
        assert [p for p in children if os.path.exists(f"/proc/{p}")] == []
    finally:
        stop_launcher(launcher, procs)


def test_printed_commands_work_as_printed_on_a_fresh_shell(tiny_checkpoint, tmp_path):
    path = cluster_yaml(tmp_path, tiny_checkpoint, 1, 1, name="byhand", cluster=FAST)
    env = _env(tmp_path)
    printed = subprocess.run(
        [sys.executable, "-m", "afd", "launch", str(path), "--print-commands"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert printed.returncode == 0, printed.stderr
    lines = dict(zip(("attn0", "ffn0"), printed.stdout.splitlines()))
    doc = yaml.safe_load(path.read_text())
    token_path = Path(env["XDG_RUNTIME_DIR"]) / "afd-tokens" / f"byhand-{doc['nodes'][0]['ports']['control']}"
    assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
    token = token_path.read_text().strip()
    for line in lines.values():
        assert line.startswith(f"{TOKEN_FILE_ENV}={token_path} ") and token not in line
    url = f"http://127.0.0.1:{doc['nodes'][0]['ports']['http']}"
    with NodeProcesses(str(tmp_path), env=env, cwd=ROOT) as shells:  # each command on a shell of its own
        for name, line in lines.items():
            shells.start(Command(name, ("bash", "-c", line)))
        shells.wait_until(lambda: health(url) == 200, 120, "the cluster started by hand to be ready")
        before = _greedy(url, PROMPTS[1])
        status = subprocess.run(
            [sys.executable, "-m", "afd", "status", str(path)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        assert status.returncode == 0, status.stdout + status.stderr  # `afd status` finds the same file
        forged = subprocess.run(  # the control plane is closed: a shell without the file is refused
            [sys.executable, "-m", "afd", "drain", str(path), "--node", "attn0"],
            cwd=ROOT,
            env={**env, "XDG_RUNTIME_DIR": str(tmp_path)},
            capture_output=True,
            text=True,
        )
        assert forged.returncode != 0 and "cluster token mismatch" in forged.stdout + forged.stderr
        shells.popen("ffn0").send_signal(signal.SIGKILL)
        shells.popen("ffn0").wait()
        shells.start(Command("ffn0", ("bash", "-c", lines["ffn0"])), log=str(tmp_path / "ffn0-again.log"))
        shells.wait_until(lambda: "data plane up" in shells.log("ffn0"), 90, "the restarted FFN node to rejoin")
        assert _greedy(url, PROMPTS[1]) == before
        assert "cluster token mismatch" not in shells.log("ffn0")


def test_an_llm_restarts_the_nodes_of_its_local_cluster(tiny_checkpoint):
    """afd.LLM's local cluster: a node killed between jobs takes the other down at once (an offline job
    waits for no replacement), and the next generate() restarts both and runs its job on them."""
    import afd

    with afd.LLM(tiny_checkpoint, attention_nodes=1, ffn_nodes=1, block_size=4, restart_backoff=0.2) as llm:
        first = llm.generate_ids([PROMPTS[2]], 6)
        local = llm._local
        old = {n: local.process(n).pid for n in ("attn0", "ffn0")}
        local.process("ffn0").kill()
        assert local.process("attn0").wait(30) == 1
        assert llm.generate_ids([PROMPTS[2]], 6) == first
        assert llm._local is local  # the same cluster, its nodes restarted
        assert all(local.process(n).pid != pid for n, pid in old.items())
        assert local.processes.supervisor.restarts("ffn0") == 1
        assert local.processes.supervisor.restarts("attn0") == 1
