"""What a local cluster is (LocalClusterSpec) and its cluster YAML: A attention and F FFN nodes on this
machine with free loopback ports, as afd.cluster.local starts them; and how to read per-step logits
back from its attention nodes' reports."""

from __future__ import annotations

from dataclasses import dataclass

STARTUP_TIMEOUT = 120.0
"""cluster.startup_timeout of a local cluster: also how long a restarted node must stay up to end a row."""


@dataclass
class LocalClusterSpec:
    model: str
    attention_nodes: int = 1
    ffn_nodes: int = 1
    dtype: str = "float32"
    quantization: str | None = None
    """model.quantization (None: the checkpoint's own, afd.quant.scheme.resolve)."""
    dummy_weights: bool = False
    seed: int = 0
    overlap: bool = True
    micro_batches: int = 0
    """0: each attention node chooses from measured times (afd.dataplane.overlap)."""
    block_size: int = 16
    speculative_tokens: int = 0
    """MTP draft tokens per step (engine.speculative_tokens; 0 off)."""
    sampling_seed: int | None = None
    """engine.sampling_seed: the nodes' default generator, for requests that bring no seed (afd.LLM's seed)."""
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
    max_restarts: int = 5
    """cluster.max_restarts: restarts in a row of a node that fails (afd.cluster.supervise)."""
    restart_backoff: float = 1.0
    """cluster.restart_backoff: seconds before the first restart of a row."""
    exchange_dtype: str = "same"
    """layout.exchange_dtype: how the MoE inputs cross to the FFN nodes (same, fp8 or int8)."""
    routing: str | None = None
    """layout.routing (None: attention with more than one FFN node)."""
    placement: dict | None = None
    """layout.placement, by FFN node index ("0": "0-7"; the local nodes' names are made here); None: the default."""
    ffn_metrics: bool = False
    """Give every FFN node a free metrics port (its /metrics: LocalCluster.metrics_urls), for what reads the
    FFN nodes' own counters (`afd profile`, `afd bench-dispatch`). Not a config field: where a node serves."""

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
    """The cluster YAML (as a dict) of a local job: every node on this machine, free ports. An offline job is
    not re-formed around a failed node (rejoin_timeout 0): it fails, naming it."""
    from afd.cluster.local_config import local_config

    layout = {"overlap": spec.overlap, "micro_batches": spec.micro_batches, "graph_mode": spec.graph_mode}
    if spec.exchange_dtype != "same":
        layout["exchange_dtype"] = spec.exchange_dtype
    if spec.routing is not None:
        layout["routing"] = spec.routing
    if spec.placement is not None:
        layout["placement"] = {f"ffn{int(k)}": v for k, v in spec.placement.items()}
    if spec.attention_tp > 1:
        layout |= {"attention_tp": spec.attention_tp, "tp_comm": spec.tp_comm, "kvp": spec.kvp}
        layout |= {"flashcomm2_otp": spec.flashcomm2_otp, "tp_comm_min_tokens": spec.tp_comm_min_tokens}
    engine = {
        "block_size": spec.block_size,
        "speculative_tokens": spec.speculative_tokens,
        "sampling_seed": spec.sampling_seed,
        "graph_batch_sizes": spec.graph_batch_sizes,
        "compile_cache_dir": spec.compile_cache_dir,
    }
    sections = {
        "cluster": {"comm_timeout": spec.comm_timeout, "startup_timeout": STARTUP_TIMEOUT, "rejoin_timeout": 0.0},
        "model": {"path": spec.model, "dtype": spec.dtype, "dummy_weights": spec.dummy_weights, "seed": spec.seed}
        | ({"quantization": spec.quantization} if spec.quantization else {}),
        "layout": {k: v for k, v in layout.items() if v is not None},
        "engine": {k: v for k, v in engine.items() if v is not None},
    }
    cfg = local_config(
        spec.attention_nodes,
        spec.ffn_nodes,
        sections,
        name="local-job",
        host=spec.attention_host,
        ffn_host=spec.ffn_host,
        threads=spec.threads,
        metrics_ports=spec.ffn_metrics,
    )
    return cfg.to_dict()


def reports_logits(spec: LocalClusterSpec, reports: list[dict], num_prompts: int) -> list:
    """Per prompt (in the job's order), its per-step fp32 logits as tensors, from the nodes' reports."""
    import torch

    out: list = [None] * num_prompts
    for a, rep in enumerate(reports):
        for i, steps in zip(range(a, num_prompts, spec.attention_nodes), rep["logits"]):
            out[i] = [torch.tensor(s, dtype=torch.float32) for s in steps]
    return out
