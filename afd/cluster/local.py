"""Runs A attention and F FFN node processes on this machine for offline generation and benchmarks.

It writes the job's cluster config (afd.cluster.local_config.local_job: every field as given, the ports picked
anew and free) as the YAML every node starts from, and starts them through the launcher
(afd.cluster.processes), as `afd launch` would: the nodes find each other through the control plane. Attention
nodes run the offline worker (`afd-attention generate`), which takes jobs one after another from a mailbox
(afd.cluster.jobs), each job's prompts dealt to them round-robin; FFN nodes serve until every attention node
has left.

A node that fails takes the others down at once (an offline job does not wait for a replacement:
rejoin_timeout 0), and while a job's results are awaited each failed node is restarted with its own command
(afd.cluster.supervise: back-off, at most `max_restarts` in a row); a restarted attention node runs its share
of the unfinished job again, from its mailbox. Past the limit the job fails with the node's log tail in the
error."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import tempfile

from afd.cluster.forkserver import ForkedProcess
from afd.cluster.jobs import JobMailbox
from afd.cluster.local_config import with_free_ports
from afd.cluster.processes import ClusterError, NodeProcesses, node_command
from afd.cluster.supervise import RestartPolicy
from afd.cluster.token import TOKEN_ENV, cluster_token
from afd.config.schema import ClusterConfig

__all__ = ["ClusterError", "LocalCluster", "reports_logits", "run_generate"]


class LocalCluster:
    """The node processes of a local cluster, kept up across jobs: `start`, then `generate` as often as
    needed, then `close` (nodes leave and exit; the FFN nodes' reports are read) or `stop` (signals).
    `with` stops it. The one-job form is `start(prompts, ...)` then `wait()`.

    config: the job's (afd.cluster.local_config.local_job); each node binds its own `host`. ffn_command_prefix:
    how to start an FFN node elsewhere, e.g. `ip netns exec NS` behind an emulated link (afd.cluster.link).
    ffn_metrics: every FFN node serves /metrics on a free port (`metrics_urls`), for what reads the FFN nodes'
    own counters (`afd profile`, `afd bench-dispatch`)."""

    def __init__(self, config: ClusterConfig, *, ffn_command_prefix: tuple[str, ...] = (), ffn_metrics: bool = False):
        self.config = config
        self.ffn_command_prefix = tuple(ffn_command_prefix)
        self.ffn_metrics = ffn_metrics
        self._tmp = tempfile.TemporaryDirectory(prefix="afd-local-")
        self.dir = self._tmp.name
        c = config.cluster
        policy = RestartPolicy(c.max_restarts, c.restart_backoff, reset_after=c.startup_timeout)
        self.processes = NodeProcesses(self.dir, restart=policy)
        self.mailboxes = [JobMailbox(os.path.join(self.dir, f"jobs-{n.name}")) for n in config.attention_nodes]
        self.ffn_reports: list[dict] = []
        self._jobs = 0
        self._pending: tuple[int, int] | None = None
        """(job number, prompts) of the job submitted and not yet collected."""
        self._closed = False
        self.doc: dict | None = None
        """The cluster YAML (as a dict) the nodes started from; None before `start`."""

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return bool(self.processes.procs) and not self._closed

    def start(
        self,
        prompts=None,
        max_tokens=None,
        params=None,
        ignore_eos: bool = False,
        logits: bool = False,
        layer_times: bool = False,
    ) -> None:
        """Starts every node; with `prompts`, submits them as the first job (collect it with `wait`)."""
        import yaml

        cfg = with_free_ports(self.config, self.ffn_metrics)
        config = os.path.join(self.dir, "cluster.yaml")
        doc = self.doc = cfg.to_dict()
        with open(config, "w") as fh:
            yaml.safe_dump(doc, fh, sort_keys=False)
        ports = {n["name"]: tuple(n["ports"].values()) for n in doc["nodes"]}
        env = dict(os.environ)  # the job's own token: nodes behind an emulated link are not on loopback
        if not cluster_token():
            env[TOKEN_ENV] = secrets.token_hex(16)
        self.processes.env = env
        commands = [
            node_command(
                config,
                "ffn",
                n.name,
                args=["--bind-host", n.host, "--report-file", self._ffn_report(n.name)],
                prefix=self.ffn_command_prefix,
                ports=ports[n.name],
            )
            for n in cfg.ffn_nodes
        ]
        for n, box in zip(cfg.attention_nodes, self.mailboxes):  # every TP rank of the node takes its jobs from rank 0
            args = ["--bind-host", n.host, "--prompts-file", box.path]
            commands += [
                node_command(config, "attention", n.name, r, args, "generate", ports=() if r else ports[n.name])
                for r in range(cfg.layout.attention_tp)
            ]
        self.processes.start_all(commands)
        if prompts is not None:
            self.submit(prompts, max_tokens, params, ignore_eos, logits, layer_times)

    @property
    def metrics_urls(self) -> dict[str, str]:
        """FFN node name -> its /metrics URL; empty unless asked for (ffn_metrics) and the cluster has started."""
        nodes = self.doc["nodes"] if self.doc is not None else []
        return {
            n["name"]: f"http://{n['host']}:{n['ports']['metrics']}/metrics"
            for n in nodes
            if n["role"] == "ffn" and n["ports"].get("metrics")
        }

    def submit(
        self,
        prompts,
        max_tokens,
        params=None,
        ignore_eos: bool = False,
        logits: bool = False,
        layer_times: bool = False,
    ) -> None:
        """Deals the prompts round-robin to the attention nodes as the next job. params: the SamplingParams
        of every prompt (greedy by default). logits: each node's report carries every prompt's per-step
        logits (`reports_logits`). layer_times: each node's report carries its runner's per-piece times of
        each layer (afd.observability.timing.LayerTimes) under "layer_times": {"samples": [[piece, layer,
        tokens, seconds], ...], "marks": [[perf_counter at the step's end, samples by then], ...] one per
        step}, what `afd profile` reads (afd.plan.profile_check); off, the runner times nothing."""
        import dataclasses

        if self._pending is not None:
            raise RuntimeError("a local cluster runs one job at a time: collect the last one first")
        per = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(prompts)
        A = len(self.mailboxes)
        for a, box in enumerate(self.mailboxes):
            mine = range(a, len(prompts), A)
            job = {
                "prompts": [prompts[i] for i in mine],
                "max_tokens": [per[i] for i in mine],
                "sampling": dataclasses.asdict(params) if params is not None else {},
                "ignore_eos": ignore_eos,
                "logits": logits,
                "layer_times": layer_times,
            }
            box.submit(self._jobs, job)
        self._pending = (self._jobs, len(prompts))
        self._jobs += 1

    def results(self, timeout_s: float = 600.0) -> tuple[list[list[int]], list[dict]]:
        """The submitted job's generated ids per prompt, and each attention node's report (steps, timings).
        A node that fails, or a job over `timeout_s`, stops the cluster and raises ClusterError."""
        if self._pending is None:
            raise RuntimeError("no job submitted")
        n, num_prompts = self._pending
        got: list[dict | None] = [None] * len(self.mailboxes)

        def collected() -> bool:
            for a, box in enumerate(self.mailboxes):
                if got[a] is None:
                    got[a] = box.result(n)
            return all(r is not None for r in got)

        try:
            self.processes.wait_until(collected, timeout_s, f"local cluster job {n}")
        except ClusterError:
            self.stop()
            raise
        self._pending = None
        reports = [r for r in got if r is not None]
        outputs: list[list[int]] = [[] for _ in range(num_prompts)]
        for a, rep in enumerate(reports):
            for i, out in zip(range(a, num_prompts, len(reports)), rep["outputs"]):
                outputs[i] = out
        return outputs, reports

    def generate(
        self,
        prompts,
        max_tokens,
        params=None,
        ignore_eos=False,
        logits=False,
        timeout_s: float = 600.0,
        layer_times: bool = False,
    ):
        """One job on the running cluster: (ids per prompt, attention nodes' reports)."""
        self.submit(prompts, max_tokens, params, ignore_eos, logits, layer_times)
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
            for n in self.config.ffn_nodes:
                with open(self._ffn_report(n.name)) as fh:
                    self.ffn_reports.append(json.load(fh))
        finally:
            self.stop()

    def _ffn_report(self, name: str) -> str:
        return os.path.join(self.dir, f"{name}.json")

    def process(self, name: str) -> subprocess.Popen | ForkedProcess:
        return self.processes.popen(name)

    def stop(self) -> None:
        """SIGTERM (attention nodes first), a grace period, then SIGKILL: nothing is left behind."""
        self._closed = True
        self.processes.stop(5.0)
        self._tmp.cleanup()


def reports_logits(reports: list[dict], num_prompts: int) -> list:
    """Per prompt (in the job's order, dealt round-robin to the attention nodes), its per-step fp32 logits as
    tensors, from the attention nodes' reports."""
    import torch

    out: list = [None] * num_prompts
    for a, rep in enumerate(reports):
        for i, steps in zip(range(a, num_prompts, len(reports)), rep["logits"]):
            out[i] = [torch.tensor(s, dtype=torch.float32) for s in steps]
    return out


def run_generate(
    config: ClusterConfig,
    prompts: list[list[int]],
    max_tokens,
    params=None,
    ignore_eos: bool = False,
    timeout_s: float = 600.0,
    logits: bool = False,
) -> tuple[list[list[int]], list[dict]]:
    with LocalCluster(config) as cluster:
        cluster.start(prompts, max_tokens, params, ignore_eos, logits)
        return cluster.wait(timeout_s)
