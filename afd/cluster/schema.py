"""The cluster YAML's shape: small frozen dataclasses, one per section, each field documented.

afd.cluster.config loads and checks a YAML into them (and re-exports them: import from there).
"""

from __future__ import annotations

from dataclasses import dataclass

from afd.cluster.placement import ExpertShard, partition_experts
from afd.model.tp.config import TPConfig

ROLES = ("attention", "ffn")
DEVICES = ("cpu", "cuda", "npu")
GRAPH_MODES = ("eager", "compile")
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


class ClusterConfigError(ValueError):
    """The cluster YAML is malformed; the message starts with the file and key path."""


@dataclass(frozen=True)
class Ports:
    control: int
    """gRPC: the node's health service (and the coordinator, on the coordinator node)."""
    data: int
    """Data-plane rendezvous (torch.distributed store); only rank 0's (the first attention node) is used."""
    http: int | None = None
    """OpenAI API, /health, /metrics (attention nodes)."""
    metrics: int | None = None
    """/health and /metrics of FFN nodes."""


@dataclass(frozen=True)
class Node:
    name: str
    role: str
    host: str
    ports: Ports
    device: str = "cpu"
    """cpu, cuda, cuda:N, npu or npu:N (no N: 0). One node per accelerator on a host: two nodes with the same
    host and device are refused (NCCL and HCCL drive a device from one process); CPU nodes share freely."""
    threads: int | None = None
    """torch intra-op threads; default on CPU: this host's usable CPUs (affinity and cgroup limit) shared
    evenly by its CPU nodes."""

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def device_index(self) -> int:
        return int(self.device.split(":")[1]) if ":" in self.device else 0

    def rank_device(self, tp_rank: int) -> str:
        """TP rank r's device: the node's device index + r (cpu for every rank of a CPU node)."""
        return self.device if self.device_type == "cpu" else f"{self.device_type}:{self.device_index + tp_rank}"


@dataclass(frozen=True)
class Process:
    """One process of the cluster: a node, or one TP rank of an attention node."""

    name: str
    """The node's name for its TP rank 0 (and every FFN node); `NODE.tpR` for rank R > 0."""
    node: Node
    tp_rank: int = 0

    @property
    def device(self) -> str:
        return self.node.rank_device(self.tp_rank)


def process_name(node: str, tp_rank: int) -> str:
    return node if tp_rank == 0 else f"{node}.tp{tp_rank}"


@dataclass(frozen=True)
class ModelSection:
    path: str
    """Checkpoint directory; `demo` is the built-in demo checkpoint (made on first use)."""
    dtype: str = "float32"
    dummy_weights: bool = False
    seed: int = 0
    max_model_len: int | None = None
    """Context limit for requests; default: the model's max_position_embeddings."""


@dataclass(frozen=True)
class Layout:
    overlap: bool = True
    micro_batches: int = 0
    """Ping-pong micro-batches (1-4); 0 chooses from measured times."""
    experts: dict | None = None
    """FFN node name -> [lo, hi) routed experts; default: an even split in node order."""
    zero_experts: str | None = None
    """FFN node that applies the identity experts; default: the first FFN node."""
    attention_tp: int = 1
    """Ranks of every attention node: TP rank r of a node is its own process (`--tp-rank r`) on device
    index (the node's) + r, and exchanges its own rows with the FFN nodes (afd.model.tp)."""
    tp_comm: str = "allreduce"
    """How the TP ranks combine row-parallel results: allreduce, sp, flashcomm1 or flashcomm2."""
    flashcomm2_otp: int | None = None
    """flashcomm2's o_proj TP group size P (attention_tp > P, attention_tp % P == 0)."""
    tp_comm_min_tokens: int | None = None
    """Micro-batches with fewer tokens run as allreduce (counted in afd_tp_comm_fallbacks_total); default:
    the seed's threshold of the mode (sp 1, flashcomm1/2 1001)."""

    kvp: int = 1
    """KV-parallel ranks (divides attention_tp): each holds 1/kvp of every sequence's KV cache, round-robin by
    block, so max_model_len grows kvp-fold (afd/model/kvp.py)."""
    graph_mode: str | None = None
    """eager or compile: decode micro-batches padded to engine.graph_batch_sizes run each layer's attention
    side as a compiled graph (afd/engine/graph.py; eager under attention_tp > 1). Unset: the device backend's
    default, chosen by measurement (`graph_mode_default` in afd/backend/; `afd bench-graph`)."""

    @property
    def tp(self) -> TPConfig:
        return TPConfig(self.attention_tp, self.tp_comm, self.flashcomm2_otp, self.tp_comm_min_tokens, self.kvp)


@dataclass(frozen=True)
class EngineSection:
    block_size: int = 16
    kv_cache_bytes: int = 256 << 20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    shutdown_timeout: float = 30.0
    """Seconds SIGTERM lets running requests finish (0 aborts them)."""
    graph_batch_sizes: tuple = GRAPH_BATCH_SIZES
    """Graph mode's batch buckets (a YAML list): a decode micro-batch of B sequences runs padded to the
    smallest bucket >= B, a larger one eager. Each bucket costs a compile (or CUDA graph memory) per
    block-table width it meets, so fewer buckets start faster and more waste less on padding."""
    compile_cache_dir: str | None = None
    """Where graph mode keeps compiled graphs for the next start: inductor's caches on CPU, torchair's
    cache_compile files on NPU (CUDA graphs are captured anew each start). Unset on CPU: inductor's own
    cache (TORCHINDUCTOR_CACHE_DIR or /tmp/torchinductor_USER); unset on NPU: torchair compiles through
    torch.compile and keeps nothing for the next start."""
    speculative_tokens: int = 0
    """MTP speculative decoding: draft tokens per step from the checkpoint's MTP module (0 off, 1 or 2);
    every node reads it (FFN nodes then hold the MTP layer's experts too)."""


@dataclass(frozen=True)
class PrefetchSection:
    """FFN-side weight prefetch while waiting for each layer's inputs (afd.dataplane.prefetch)."""

    enabled: bool | None = None
    """Unset: the backend's default (on for Ascend NPU; off on CPU and CUDA, see docs/benchmarks.md)."""
    budget_bytes: int = 8 << 20
    weights: list | None = None
    """Any of router, gate_up, down, in prefetch order (default: all three)."""
    next_layer: bool = True


@dataclass(frozen=True)
class ClusterSection:
    name: str = "afd"
    coordinator: str | None = None
    """Node hosting the coordinator; default: the first attention node."""
    startup_timeout: float = 120.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    comm_timeout: float = 60.0
    rejoin_timeout: float = 60.0
    """Seconds the surviving nodes wait, their requests paused, for a failed node's replacement to
    register (the same command started again); 0 fails the requests at once."""
    tls: dict | None = None
    """Optional {cert, key, ca} file paths for the control plane."""
    insecure: bool = False
    """Let nodes whose host is not loopback start without AFD_CLUSTER_TOKEN (an open control plane)."""


@dataclass(frozen=True)
class ClusterConfig:
    cluster: ClusterSection
    model: ModelSection
    layout: Layout
    engine: EngineSection
    nodes: tuple[Node, ...]
    prefetch: PrefetchSection = PrefetchSection()
    source: str = "<dict>"

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise ClusterConfigError(f"{self.source}: no node named {name!r} (nodes: {', '.join(self.names)})")

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    @property
    def attention_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.role == "attention"]

    @property
    def ffn_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.role == "ffn"]

    @property
    def coordinator(self) -> Node:
        return self.node(self.cluster.coordinator or self.attention_nodes[0].name)

    @property
    def processes(self) -> list[Process]:
        """In data-plane rank order: every attention node's TP ranks, then the FFN nodes, in file order."""
        tp = self.layout.attention_tp
        return [Process(process_name(n.name, r), n, r) for n in self.attention_nodes for r in range(tp)] + [
            Process(n.name, n) for n in self.ffn_nodes
        ]

    @property
    def process_names(self) -> list[str]:
        return [p.name for p in self.processes]

    def process(self, name: str) -> Process:
        for p in self.processes:
            if p.name == name:
                return p
        raise ClusterConfigError(
            f"{self.source}: no node or TP rank named {name!r} (processes: {', '.join(self.process_names)})"
        )

    def rank(self, name: str) -> int:
        """Data-plane rank of a process (a node's name: its TP rank 0)."""
        return self.process_names.index(name)

    def tp_ranks(self, node: str) -> list[int]:
        """The data-plane ranks of an attention node's TP group, in TP-rank order."""
        first = self.rank(node)
        return list(range(first, first + self.layout.attention_tp))

    @property
    def colocated(self) -> bool:
        """No FFN nodes: every attention node runs the experts itself."""
        return not self.ffn_nodes

    def expert_shard(self, name: str, n_routed: int | None = None) -> ExpertShard:
        ffn = [n.name for n in self.ffn_nodes]
        zero = self.layout.zero_experts or ffn[0]
        if self.layout.experts:
            lo, hi = self.layout.experts[name]
            return ExpertShard(lo, hi, name == zero)
        if n_routed is None:
            raise ValueError("n_routed is needed for the default expert split")
        shard = partition_experts(n_routed, len(ffn))[ffn.index(name)]
        return ExpertShard(shard.lo, shard.hi, name == zero)

    @property
    def topology_name(self) -> str:
        lay = self.layout
        tp = f" (attention tp {lay.attention_tp}, {lay.tp_comm})" if lay.attention_tp > 1 else ""
        return f"{len(self.attention_nodes)}A{len(self.ffn_nodes)}F{tp}"
