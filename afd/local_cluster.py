"""Runs A attention and F FFN node processes on this machine for offline generation and benchmarks.

Ranks: attention nodes 0..A-1, FFN nodes A..A+F-1. Prompts are dealt round-robin to attention nodes;
the FFN nodes split the routed experts (afd.placement). A node that fails takes the others down and
its log tail is in the error.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from afd.placement import partition_experts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ClusterError(RuntimeError):
    """A node process of a local cluster failed."""


@dataclass
class LocalClusterSpec:
    model: str
    attention_nodes: int = 1
    ffn_nodes: int = 1
    dtype: str = "float32"
    dummy_weights: bool = False
    seed: int = 0
    overlap: bool = True
    micro_batches: int = 0
    """0: each attention node chooses from measured times (afd.overlap)."""
    block_size: int = 16
    threads: int = 1
    comm_timeout: float = 60.0

    def __post_init__(self):
        if self.attention_nodes < 1 or self.ffn_nodes < 1:
            raise ValueError("need at least one attention node and one FFN node")
        if not 0 <= self.micro_batches <= 4:
            raise ValueError(f"--micro-batches must be in 0..4 (0: automatic), got {self.micro_batches}")


def _common(spec: LocalClusterSpec, rank: int, world: int, port: int, peers: list[int]) -> list[str]:
    args = ["--model", spec.model, "--dtype", spec.dtype, "--seed", str(spec.seed), "--threads",
            str(spec.threads), "--rank", str(rank), "--world-size", str(world), "--master-port", str(port),
            "--peer-ranks", ",".join(map(str, peers)), "--comm-timeout", str(spec.comm_timeout)]
    return args + (["--dummy-weights"] if spec.dummy_weights else [])


class LocalCluster:
    """The node processes of one offline job; `start`, then `wait`, `stop` always (or use `with`)."""

    def __init__(self, spec: LocalClusterSpec):
        self.spec = spec
        self._tmp = tempfile.TemporaryDirectory(prefix="afd-local-")
        self.dir = self._tmp.name
        self.procs: list[tuple[str, subprocess.Popen, str]] = []
        self._shares: list[list[int]] = []

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, prompts: list[list[int]], max_tokens, temperature: float = 0.0,
              ignore_eos: bool = False) -> None:
        from afd.config import ModelConfig

        spec = self.spec
        n_routed = ModelConfig.from_dir(spec.model).n_routed_experts
        A, F = spec.attention_nodes, spec.ffn_nodes
        world, port = A + F, free_port()
        per = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(prompts)
        self.num_prompts = len(prompts)
        for f, shard in enumerate(partition_experts(n_routed, F)):
            cmd = [sys.executable, "-m", "ffn_node.main", *_common(spec, A + f, world, port, list(range(A))),
                   "--expert-range", f"{shard.lo}:{shard.hi}",
                   "--report-file", os.path.join(self.dir, f"ffn{f}.json")]
            if not shard.serves_zero_experts:
                cmd.append("--no-zero-experts")
            self.procs.append(_spawn(f"ffn{f}", cmd, self.dir))
        for a in range(A):
            mine = list(range(a, len(prompts), A))
            self._shares.append(mine)
            pfile = os.path.join(self.dir, f"prompts{a}.json")
            with open(pfile, "w") as fh:
                json.dump({"prompts": [prompts[i] for i in mine], "max_tokens": [per[i] for i in mine],
                           "temperature": temperature, "ignore_eos": ignore_eos}, fh)
            cmd = [sys.executable, "-m", "attention_node.main", "generate",
                   *_common(spec, a, world, port, list(range(A, world))), "--prompts-file", pfile,
                   "--output-file", os.path.join(self.dir, f"out{a}.json"),
                   "--micro-batches", str(spec.micro_batches), "--block-size", str(spec.block_size)]
            if not spec.overlap:
                cmd.append("--no-overlap")
            self.procs.append(_spawn(f"attention{a}", cmd, self.dir))

    def process(self, name: str) -> subprocess.Popen:
        return next(p for n, p, _ in self.procs if n == name)

    def wait(self, timeout_s: float = 600.0) -> tuple[list[list[int]], list[dict]]:
        """Generated ids per prompt, and each attention node's report (steps, timings); the FFN nodes'
        reports (compute and idle seconds) are in `self.ffn_reports` afterwards."""
        _wait_all(self.procs, timeout_s)
        outputs: list[list[int]] = [[] for _ in range(self.num_prompts)]
        reports = []
        for a, mine in enumerate(self._shares):
            with open(os.path.join(self.dir, f"out{a}.json")) as fh:
                rep = json.load(fh)
            for i, out in zip(mine, rep["outputs"]):
                outputs[i] = out
            reports.append(rep)
        self.ffn_reports = []
        for f in range(self.spec.ffn_nodes):
            with open(os.path.join(self.dir, f"ffn{f}.json")) as fh:
                self.ffn_reports.append(json.load(fh))
        return outputs, reports

    def stop(self) -> None:
        _stop(self.procs)
        self._tmp.cleanup()


def run_generate(spec: LocalClusterSpec, prompts: list[list[int]], max_tokens, temperature: float = 0.0,
                 ignore_eos: bool = False, timeout_s: float = 600.0) -> tuple[list[list[int]], list[dict]]:
    with LocalCluster(spec) as cluster:
        cluster.start(prompts, max_tokens, temperature, ignore_eos)
        return cluster.wait(timeout_s)


def _spawn(name: str, cmd: list[str], tmp: str) -> tuple[str, subprocess.Popen, str]:
    log = os.path.join(tmp, f"{name}.log")
    with open(log, "w") as fh:
        p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    return name, p, log


def _tail(path: str, n: int = 15) -> str:
    with open(path, errors="replace") as fh:
        return "".join(fh.readlines()[-n:])


def _wait_all(procs, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [(name, p.poll(), log) for name, p, log in procs]
        failed = [(name, rc, log) for name, rc, log in codes if rc not in (None, 0)]
        if failed:
            name, rc, log = failed[0]
            _stop(procs)
            raise ClusterError(f"node {name} exited with code {rc}; its log ends:\n{_tail(log)}")
        if all(rc == 0 for _, rc, _ in codes):
            return
        if time.monotonic() > deadline:
            _stop(procs)
            raise ClusterError(f"local cluster did not finish within {timeout_s:.0f}s")
        time.sleep(0.05)


def _stop(procs) -> None:
    """SIGTERM, a grace period, then SIGKILL: nothing is left behind."""
    for _, p, _ in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    t_end = time.monotonic() + 5
    for _, p, _ in procs:
        try:
            p.wait(max(0.0, t_end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
