"""Runs A attention and F FFN node processes on this machine for offline generation and benchmarks.

It writes a cluster YAML on 127.0.0.1 with free ports and starts every node from it, as `afd launch`
would: the nodes find each other through the control plane. Attention nodes run the offline worker
(`afd-attention generate`) on the prompts dealt to them round-robin; FFN nodes serve until every
attention node has left. A node that fails takes the others down and its log tail is in the error.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from afd.cluster.token import TOKEN_ENV, cluster_token


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, grandchildren, ...), from /proc."""
    from pathlib import Path

    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


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
    """0: each attention node chooses from measured times (afd.dataplane.overlap)."""
    block_size: int = 16
    speculative_tokens: int = 0
    """MTP draft tokens per step (engine.speculative_tokens; 0 off)."""
    threads: int = 1
    comm_timeout: float = 60.0
    attention_host: str = "127.0.0.1"
    ffn_host: str = "127.0.0.1"
    ffn_command_prefix: tuple[str, ...] = ()
    """How to start an FFN node elsewhere, e.g. `ip netns exec NS` behind an emulated link (afd.cluster.link)."""
    attention_tp: int = 1
    """TP ranks (processes) per attention node."""
    tp_comm: str = "allreduce"
    flashcomm2_otp: int | None = None
    tp_comm_min_tokens: int | None = None
    kvp: int = 1
    graph_mode: str | None = None
    """layout.graph_mode (None: the backend's default)."""
    graph_batch_sizes: tuple[int, ...] | None = None
    compile_cache_dir: str | None = None

    def __post_init__(self):
        if self.attention_nodes < 1 or self.ffn_nodes < 0:
            raise ValueError(
                "need at least one attention node (and 0 or more FFN nodes: 0 runs the experts on the attention nodes)"
            )
        from afd.model.tp.config import TPConfig

        TPConfig(self.attention_tp, self.tp_comm, self.flashcomm2_otp, self.tp_comm_min_tokens, self.kvp)  # validates
        if not 0 <= self.micro_batches <= 4:
            raise ValueError(f"--micro-batches must be in 0..4 (0: automatic), got {self.micro_batches}")


def cluster_doc(spec: LocalClusterSpec) -> dict:
    """The cluster YAML (as a dict) of a local job: every node on 127.0.0.1, free ports."""
    A, F = spec.attention_nodes, spec.ffn_nodes
    ports = iter(free_ports(3 * (A + F)))
    nodes = [
        {
            "name": f"attn{a}",
            "role": "attention",
            "host": spec.attention_host,
            "threads": spec.threads,
            "ports": {"control": next(ports), "data": next(ports), "http": next(ports)},
        }
        for a in range(A)
    ]
    nodes += [
        {
            "name": f"ffn{f}",
            "role": "ffn",
            "host": spec.ffn_host,
            "threads": spec.threads,
            "ports": {"control": next(ports), "data": next(ports)},
        }
        for f in range(F)
    ]
    # an offline job is not re-formed around a failed node: it fails, naming it
    return {
        "cluster": {
            "name": "local-job",
            "comm_timeout": spec.comm_timeout,
            "startup_timeout": 120,
            "rejoin_timeout": 0,
        },
        "model": {"path": spec.model, "dtype": spec.dtype, "dummy_weights": spec.dummy_weights, "seed": spec.seed},
        "layout": {
            "overlap": spec.overlap,
            "micro_batches": spec.micro_batches,
            **_tp_layout(spec),
            **({"graph_mode": spec.graph_mode} if spec.graph_mode else {}),
        },
        "engine": {"block_size": spec.block_size, **_speculative(spec), **_graph_engine(spec)},
        "nodes": nodes,
    }


def _graph_engine(spec: LocalClusterSpec) -> dict:
    out = {"graph_batch_sizes": list(spec.graph_batch_sizes)} if spec.graph_batch_sizes else {}
    return out | ({"compile_cache_dir": spec.compile_cache_dir} if spec.compile_cache_dir else {})


def _speculative(spec: LocalClusterSpec) -> dict:
    return {"speculative_tokens": spec.speculative_tokens} if spec.speculative_tokens else {}


def _tp_layout(spec: LocalClusterSpec) -> dict:
    if spec.attention_tp == 1:
        return {}
    out = {"attention_tp": spec.attention_tp, "tp_comm": spec.tp_comm}
    if spec.flashcomm2_otp is not None:
        out["flashcomm2_otp"] = spec.flashcomm2_otp
    if spec.tp_comm_min_tokens is not None:
        out["tp_comm_min_tokens"] = spec.tp_comm_min_tokens
    if spec.kvp > 1:
        out["kvp"] = spec.kvp
    return out


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

    def start(
        self, prompts: list[list[int]], max_tokens, params=None, ignore_eos: bool = False, logits: bool = False
    ) -> None:
        """params: the SamplingParams of every prompt (greedy by default). logits: each attention node's
        report carries every prompt's per-step logits (`reports_logits`)."""
        import dataclasses

        import yaml

        spec = self.spec
        config = os.path.join(self.dir, "cluster.yaml")
        with open(config, "w") as fh:
            yaml.safe_dump(cluster_doc(spec), fh, sort_keys=False)
        per = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(prompts)
        self.num_prompts = len(prompts)
        env = dict(os.environ)  # the job's own token: nodes behind an emulated link are not on loopback
        if not cluster_token():
            env[TOKEN_ENV] = secrets.token_hex(16)
        node = ["--config", config, "--bind-host", spec.ffn_host, "--node"]
        for f in range(spec.ffn_nodes):
            cmd = [
                *spec.ffn_command_prefix,
                sys.executable,
                "-m",
                "ffn_node.main",
                *node,
                f"ffn{f}",
                "--report-file",
                os.path.join(self.dir, f"ffn{f}.json"),
            ]
            self.procs.append(_spawn(f"ffn{f}", cmd, self.dir, env))
        node = ["--config", config, "--bind-host", spec.attention_host, "--node"]
        for a in range(spec.attention_nodes):
            mine = list(range(a, len(prompts), spec.attention_nodes))
            self._shares.append(mine)
            pfile = os.path.join(self.dir, f"prompts{a}.json")
            with open(pfile, "w") as fh:
                json.dump(
                    {
                        "prompts": [prompts[i] for i in mine],
                        "max_tokens": [per[i] for i in mine],
                        "sampling": dataclasses.asdict(params) if params is not None else {},
                        "ignore_eos": ignore_eos,
                        "logits": logits,
                    },
                    fh,
                )
            cmd = [
                sys.executable,
                "-m",
                "attention_node.main",
                "generate",
                *node,
                f"attn{a}",
                "--prompts-file",
                pfile,
                "--output-file",
                os.path.join(self.dir, f"out{a}.json"),
            ]
            self.procs.append(_spawn(f"attention{a}", cmd, self.dir, env))
            for r in range(1, spec.attention_tp):  # the node's other TP ranks, on the same prompts
                cmd = [
                    sys.executable,
                    "-m",
                    "attention_node.main",
                    "generate",
                    *node,
                    f"attn{a}",
                    "--prompts-file",
                    pfile,
                    "--tp-rank",
                    str(r),
                ]
                self.procs.append(_spawn(f"attention{a}.tp{r}", cmd, self.dir, env))

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


def run_generate(
    spec: LocalClusterSpec,
    prompts: list[list[int]],
    max_tokens,
    params=None,
    ignore_eos: bool = False,
    timeout_s: float = 600.0,
    logits: bool = False,
) -> tuple[list[list[int]], list[dict]]:
    with LocalCluster(spec) as cluster:
        cluster.start(prompts, max_tokens, params, ignore_eos, logits)
        return cluster.wait(timeout_s)


def reports_logits(spec: LocalClusterSpec, reports: list[dict], num_prompts: int) -> list:
    """Per prompt (in the job's order), its per-step fp32 logits as tensors, from the nodes' reports."""
    import torch

    out: list = [None] * num_prompts
    for a, rep in enumerate(reports):
        for i, steps in zip(range(a, num_prompts, spec.attention_nodes), rep["logits"]):
            out[i] = [torch.tensor(s, dtype=torch.float32) for s in steps]
    return out


def _spawn(name: str, cmd: list[str], tmp: str, env: dict | None = None) -> tuple[str, subprocess.Popen, str]:
    log = os.path.join(tmp, f"{name}.log")
    with open(log, "w") as fh:
        p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, env=env)
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
