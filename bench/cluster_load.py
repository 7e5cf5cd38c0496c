"""The cluster a benchmark runs and the load it puts on it (bench/failover.py): the YAML with free ports, its node
processes under `afd launch` or each from its printed command, `afd status` and /health polled side by side, and
greedy streams back to back with every request's record and their summary."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import yaml

from afd.bench.streams import stream_timed
from afd.cluster.processes import descendants, free_ports

HEADERS: dict[str, str] = {}
"""Sent with every request the benchmark makes: the API key's, under --hostile."""


def cluster_copy(src: str, tmp: str) -> tuple[str, dict]:
    """src with every port moved to a free one; returns its path and its document."""
    doc = yaml.safe_load(Path(src).read_text())
    ports = iter(free_ports(sum(len(n["ports"]) for n in doc["nodes"])))
    for n in doc["nodes"]:
        n["ports"] = {k: next(ports) for k in n["ports"]}
    path = os.path.join(tmp, os.path.basename(src))
    Path(path).write_text(yaml.safe_dump(doc))
    return path, doc


def afd_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "afd", *args]


class Cluster:
    """The cluster's node processes: under one `afd launch`, or each started from its printed command."""

    def __init__(self, path: str, launcher: str):
        self.path, self.launcher, self.procs = path, launcher, {}
        doc = yaml.safe_load(Path(path).read_text())
        self.metrics = {
            n["name"]: f"http://{n['host']}:{n['ports']['metrics']}" for n in doc["nodes"] if "metrics" in n["ports"]
        }
        self.log = open(os.path.join(os.path.dirname(path), "cluster.log"), "w")  # noqa: SIM115
        if launcher == "launch":
            self.procs["launch"] = self._start(shlex.join(afd_command("launch", path)))
            return
        printed = subprocess.run(
            afd_command("launch", path, "--print-commands"), check=True, capture_output=True, text=True
        )
        self.commands = {}
        for line in printed.stdout.splitlines():
            if "--node" in line and not line.lstrip().startswith("#"):
                words = shlex.split(line, comments=True)
                self.commands[words[words.index("--node") + 1]] = line
        for name, line in self.commands.items():
            self.procs[name] = self._start(line)

    def _start(self, line: str) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k != "AFD_CLUSTER_TOKEN"}  # a second shell's
        bindir = os.path.dirname(sys.executable)
        env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
        return subprocess.Popen(
            ["bash", "-c", line], stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def pid(self, node: str) -> int | None:
        for p in self.procs.values():
            for pid in [p.pid, *descendants(p.pid)]:
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if b"--node" in cmd and cmd[cmd.index(b"--node") + 1].decode() == node and b"bash" not in cmd[0]:
                    return pid
        return None

    def hang(self, node: str, seconds: float) -> int:
        """SIGSTOP now, SIGCONT `seconds` later (from a timer): the node hangs, it does not die."""
        pid = self.pid(node)
        assert pid is not None, f"no process for {node}"
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(seconds, lambda: os.kill(pid, signal.SIGCONT)).start()
        return pid

    def kill(self, node: str) -> int:
        pid = self.pid(node)
        assert pid is not None, f"no process for {node}"
        os.kill(pid, signal.SIGKILL)
        if self.launcher == "hand":  # the user's second shell: wait for it to go, run its command again
            self.procs[node].wait(30)
            self.procs[node] = self._start(self.commands[node])
        return pid

    def stop(self) -> None:
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        self.log.close()


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 (not up yet)
        return False


def node_back(cluster: Cluster, node: str, old: int, attention: dict[str, str]) -> bool:
    """A new process holds the node, and an attention node answers /health."""
    if cluster.pid(node) in (None, old):
        return False
    return answers(attention[node] + "/health") if node in attention else answers(cluster.metrics[node] + "/metrics")


def status(path: str) -> dict | None:
    r = subprocess.run(afd_command("status", path, "--json"), capture_output=True, text=True, timeout=30)
    try:
        return json.loads(r.stdout)
    except json.JSONDecodeError:
        return None


def cluster_ready(path: str, doc: dict) -> bool:
    st = status(path)
    return st is not None and st.get("state") == "READY" and len(st.get("ready", [])) == len(doc["nodes"])


class Agreement:
    """/health of every attention node and `afd status`, polled every 0.5 s until stopped: the moments they
    disagreed. A node agrees when its /health is 200 exactly when the status is READY, or DEGRADED without
    naming it (lost, or its requests paused). The stopped node itself is left out until it is continued: a
    stopped process answers nothing. /health is read before and after each status (which takes a process of
    its own); a node whose answer changed meanwhile is not compared."""

    def __init__(self, path: str, attention: dict[str, str], stopped: str, until: float):
        self.path, self.attention, self.polls, self.disagreements = path, attention, 0, []
        self.stopped, self.until = stopped, until
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self.stop.wait(0.5):
            skip = self.stopped if time.monotonic() < self.until + 0.5 else None
            before = {n: answers(u + "/health") for n, u in self.attention.items() if n != skip}
            st = status(self.path)  # a process of its own: a fraction of a second
            after = {n: answers(u + "/health") for n, u in self.attention.items() if n != skip}
            # a node whose /health changed across the status call is no disagreement: either may be first
            health = {n: ok for n, ok in after.items() if before.get(n) == ok}
            self.polls += 1
            if st is None:
                continue  # the coordinator is what hangs or restarts: nothing to compare with
            state, text = st.get("state"), json.dumps(st)
            for node, ok in health.items():
                serves = state == "READY" or (state == "DEGRADED" and node not in st.get("lost", []))
                serves = serves and f"{node}: requests paused" not in text
                if ok != serves:
                    self.disagreements.append(
                        {"t_s": round(time.monotonic() - t0, 1), "node": node, "health": ok, "state": state}
                    )

    def join(self) -> dict:
        self.stop.set()
        self.thread.join(60)
        return {"polls": self.polls, "disagreements": len(self.disagreements), "first": self.disagreements[:3]}


def serves(url: str, prompt: list[int]) -> bool:
    """A new one-token request completes."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    return bool(stream_timed(url, body, timeout=5, headers=HEADERS)["ids"])


def wait_for(what: str, cond, timeout: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.25)
    print(f"  {what}: not within {timeout:.0f}s", flush=True)
    return None


class Load:
    """`n` streams on one attention node, back to back until stopped; every request's record kept."""

    def __init__(self, url: str, prompts: list[list[int]], max_tokens: int, n: int):
        self.url, self.prompts, self.max_tokens, self.records = url, prompts, max_tokens, []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        k = i
        while not self.stop.is_set():
            body = {"prompt": self.prompts[k % len(self.prompts)], "max_tokens": self.max_tokens}
            body.update(temperature=0, ignore_eos=True)
            rec = stream_timed(self.url, body, timeout=120, headers=HEADERS)
            rec["prompt"] = k % len(self.prompts)
            self.records.append(rec)
            if not rec["ids"]:  # the node is down or refusing: do not spin
                time.sleep(0.5)
            k += len(self.threads)

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(150)


def summary(records: list[dict], refs: dict[int, list[int]], t0: float, t1: float, n: int) -> dict:
    """Requests that ran during [t0, t1]: done (all n tokens, no error), failed, tokens compared, and the
    largest gap between two chunks of one stream (or its start and first chunk) inside it."""
    during = [r for r in records if r["start"] < t1 and r["end"] > t0]
    refused = [r for r in during if not r["ids"] and any("Connection refused" in e for e in r["errors"])]
    during = [r for r in during if r not in refused]  # tries while nothing listened: not requests it took
    done = [r for r in during if not r["errors"] and len(r["ids"]) == n]
    # from the request's start: a stream sent while the plane was down waits for its first chunk, a stall too
    ticks = [[r["start"], *r["times"]] for r in during]
    gaps = [b - a for t in ticks for a, b in zip(t, t[1:]) if b > t0 and a < t1]
    return {
        "requests": len(during),
        "done": len(done),
        "failed": len(during) - len(done),
        "refused_while_down": len(refused),
        "identical": sum(r["ids"] == refs[r["prompt"]] for r in done),
        "largest_gap_s": round(max(gaps, default=0.0), 3),
        "errors": sorted({e for r in during for e in r["errors"]})[:3],
    }
