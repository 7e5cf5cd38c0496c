"""Runs A attention and F FFN node processes on this machine for offline generation and benchmarks.

It writes a cluster YAML on 127.0.0.1 with free ports and starts every node from it through the
launcher (afd.cluster.processes), as `afd launch` would: the nodes find each other through the control
plane. Attention nodes run the offline worker (`afd-attention generate`), which takes jobs one after
another from a mailbox (afd.cluster.jobs), each job's prompts dealt to them round-robin; FFN nodes serve
until every attention node has left. A node that fails takes the others down and its log tail is in the
error.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import tempfile
from dataclasses import dataclass

from afd.cluster.jobs import JobMailbox
from afd.cluster.processes import ClusterError, NodeProcesses, node_command
from afd.cluster.token import TOKEN_ENV, cluster_token

__all__ = ["ClusterError", "LocalCluster", "LocalClusterSpec", "cluster_doc", "free_ports", "run_generate"]


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
    """The node processes of a local cluster, kept up across jobs: `start`, then `generate` as often as
    needed, then `close` (nodes leave and exit; the FFN nodes' reports are read) or `stop` (signals).
    `with` stops it. The one-job form is `start(prompts, ...)` then `wait()`."""

    def __init__(self, spec: LocalClusterSpec):
        self.spec = spec
        self._tmp = tempfile.TemporaryDirectory(prefix="afd-local-")
        self.dir = self._tmp.name
        self.processes = NodeProcesses(self.dir)
        self.mailboxes = [JobMailbox(os.path.join(self.dir, f"jobs-attn{a}")) for a in range(spec.attention_nodes)]
        self.ffn_reports: list[dict] = []
        self._jobs = 0
        self._pending: tuple[int, int] | None = None
        """(job number, prompts) of the job submitted and not yet collected."""
        self._closed = False

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return bool(self.processes.procs) and not self._closed

    def start(self, prompts=None, max_tokens=None, params=None, ignore_eos: bool = False, logits: bool = False) -> None:
        """Starts every node; with `prompts`, submits them as the first job (collect it with `wait`)."""
        import yaml

        spec = self.spec
        config = os.path.join(self.dir, "cluster.yaml")
        with open(config, "w") as fh:
            yaml.safe_dump(cluster_doc(spec), fh, sort_keys=False)
        env = dict(os.environ)  # the job's own token: nodes behind an emulated link are not on loopback
        if not cluster_token():
            env[TOKEN_ENV] = secrets.token_hex(16)
        self.processes.env = env
        commands = [
            node_command(
                config,
                "ffn",
                f"ffn{f}",
                args=["--bind-host", spec.ffn_host, "--report-file", os.path.join(self.dir, f"ffn{f}.json")],
                prefix=spec.ffn_command_prefix,
            )
            for f in range(spec.ffn_nodes)
        ]
        for a, box in enumerate(self.mailboxes):  # every TP rank of the node takes its jobs from rank 0
            args = ["--bind-host", spec.attention_host, "--prompts-file", box.path]
            commands += [
                node_command(config, "attention", f"attn{a}", r, args, mode="generate")
                for r in range(spec.attention_tp)
            ]
        self.processes.start_all(commands)
        if prompts is not None:
            self.submit(prompts, max_tokens, params, ignore_eos, logits)

    def submit(self, prompts, max_tokens, params=None, ignore_eos: bool = False, logits: bool = False) -> None:
        """Deals the prompts round-robin to the attention nodes as the next job. params: the SamplingParams
        of every prompt (greedy by default). logits: each node's report carries every prompt's per-step
        logits (`reports_logits`)."""
        import dataclasses

        if self._pending is not None:
            raise RuntimeError("a local cluster runs one job at a time: collect the last one first")
        per = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(prompts)
        A = self.spec.attention_nodes
        for a, box in enumerate(self.mailboxes):
            mine = range(a, len(prompts), A)
            job = {
                "prompts": [prompts[i] for i in mine],
                "max_tokens": [per[i] for i in mine],
                "sampling": dataclasses.asdict(params) if params is not None else {},
                "ignore_eos": ignore_eos,
                "logits": logits,
            }
            box.submit(self._jobs, job)
        self._pending = (self._jobs, len(prompts))
        self._jobs += 1

    def results(self, timeout_s: float = 600.0) -> tuple[list[list[int]], list[dict]]:
        """The submitted job's generated ids per prompt, and each attention node's report (steps, timings).
        A node that fails, or a job over `timeout_s`, stops the cluster and raises ClusterError."""
        n, num_prompts = self._pending
        reports: list[dict | None] = [None] * len(self.mailboxes)

        def collected() -> bool:
            for a, box in enumerate(self.mailboxes):
                if reports[a] is None:
                    reports[a] = box.result(n)
            return all(r is not None for r in reports)

        try:
            self.processes.wait_until(collected, timeout_s, f"local cluster job {n}")
        except ClusterError:
            self.stop()
            raise
        self._pending = None
        outputs: list[list[int]] = [[] for _ in range(num_prompts)]
        for a, rep in enumerate(reports):
            for i, out in zip(range(a, num_prompts, len(reports)), rep["outputs"]):
                outputs[i] = out
        return outputs, reports

    def generate(self, prompts, max_tokens, params=None, ignore_eos=False, logits=False, timeout_s: float = 600.0):
        """One job on the running cluster: (ids per prompt, attention nodes' reports)."""
        self.submit(prompts, max_tokens, params, ignore_eos, logits)
        return self.results(timeout_s)

    def wait(self, timeout_s: float = 600.0) -> tuple[list[list[int]], list[dict]]:
        """The one-job form: the job's results, then `close`; the FFN nodes' reports (compute and idle
        seconds) are in `self.ffn_reports` afterwards."""
        out = self.results(timeout_s)
        self.close()
        return out

    def close(self, timeout_s: float = 60.0) -> None:
        """The attention nodes leave, the FFN nodes follow and write their reports, every process exits;
        one that does not within `timeout_s` is stopped, and that is a ClusterError."""
        if self._closed or not self.processes.procs:
            self.stop()
            return
        for box in self.mailboxes:
            box.stop()
        try:
            self.processes.wait_exit(timeout_s, "the local cluster's nodes")
            self.ffn_reports = []
            for f in range(self.spec.ffn_nodes):
                with open(os.path.join(self.dir, f"ffn{f}.json")) as fh:
                    self.ffn_reports.append(json.load(fh))
        finally:
            self.stop()

    def process(self, name: str) -> subprocess.Popen:
        return self.processes.popen(name)

    def stop(self) -> None:
        """SIGTERM (attention nodes first), a grace period, then SIGKILL: nothing is left behind."""
        self._closed = True
        self.processes.stop(5.0)
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
