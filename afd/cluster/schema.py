"""The cluster YAML's shape: small frozen dataclasses, one per section, each field documented.

This is afd's one configuration. afd.cluster.config loads and checks a YAML into it and writes it back
(`to_dict`); a field declared with `opt(default, "--flag")` is also that command-line option in every
command that takes it, its docstring the option's help (afd.cluster.flags generates them), and a keyword
of `afd.LLM(model, **overrides)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from afd.cluster.fieldspec import (
    count_arg,
    dtype_arg,
    fraction_arg,
    micro_batches_arg,
    opt,
    positive_int,
    size_arg,
    speculative_count,
)
from afd.cluster.http_section import HttpSection
from afd.cluster.placement import Placement, default_placement, from_yaml
from afd.model.tp.config import MODES as TP_MODES
from afd.model.tp.config import TPConfig
from afd.quant.scheme import METHODS as QUANT_METHODS

ROLES = ("attention", "ffn")
DEVICES = ("cpu", "cuda", "npu")
GRAPH_MODES = ("eager", "compile")
ROUTINGS = ("attention", "ffn")
"""layout.routing: where the router runs, and so which FFN nodes a token's hidden state goes to."""
EXCHANGE_DTYPES = ("same", "fp8", "int8")
"""layout.exchange_dtype: how the MoE inputs cross to the FFN nodes (afd.dataplane.protocol)."""
DTYPES = ("auto", "float32", "bfloat16", "float16")
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
SECTION_KEYS = ("cluster", "model", "layout", "engine", "prefetch", "http")
"""The YAML's sections besides `nodes`."""


class ClusterConfigError(ValueError):
    """The cluster YAML is malformed; the message starts with the file and key path."""


@dataclass(frozen=True)
class Ports:
    control: int
    """gRPC: the node's health service and the data plane's rendezvous store (and the coordinator, on the
    coordinator node)."""
    data: int
    """Reserved: the data-plane rendezvous moved to the control port (behind the cluster token); nothing
    listens here."""
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
    path: str = opt(None, "--model")
    """Checkpoint directory (an HF checkpoint of a supported family), a Hugging Face hub name (Qwen/Qwen3-30B-A3B:
    the local cache first, then a download unless HF_HUB_OFFLINE=1), or `demo`: the built-in demo checkpoint,
    made on first use."""
    dtype: str = opt("auto", "--dtype", choices=DTYPES, parse=dtype_arg)
    """Weights and activations: auto (vLLM's default) takes the checkpoint's config.json dtype, float32 where it
    names none (the flag also takes vLLM's half and float)."""
    quantization: str | None = opt(None, "--quantization", choices=QUANT_METHODS)
    """fp8 (FP8 weights per 128x128 block, FP8 activations per token), w8a8 (int8 weights per channel, int8
    activations per token) or w8a16 (8-bit weights widened in the GEMM, activations in dtype); default: the
    checkpoint's (fp8 for a released FP8 checkpoint, else none). A bf16/fp32 checkpoint is quantized at load."""
    dummy_weights: bool = opt(False, "--dummy-weights")
    """Seeded random weights: only the checkpoint's config.json is read."""
    seed: int = opt(0, "--weights-seed")
    """Seed of the dummy weights (every node draws the same tensors from it)."""
    max_model_len: int | None = opt(None, "--max-model-len", parse=positive_int)
    """Context limit of a request; default: the model's max_position_embeddings (or what the KV cache holds)."""
    revision: str | None = opt(None, "--revision")
    """A hub name's branch, tag or commit (default: main); ignored for a local directory."""
    download_dir: str | None = opt(None, "--download-dir")
    """Where a hub name's files are looked up and downloaded (default: the Hugging Face cache, HF_HUB_CACHE)."""
    served_model_name: str | None = opt(None, "--served-model-name")
    """The model's name in the API and in metrics labels; default: the model path as given."""
    chat_template: str | None = opt(None, "--chat-template")
    """A Jinja chat template, or a file holding one; default: the tokenizer's."""


@dataclass(frozen=True)
class Layout:
    overlap: bool = opt(True, "--overlap")
    """Hide each MoE exchange behind the attention side's work; off (`--no-overlap`) waits for each result at
    once (the baseline)."""
    micro_batches: int = opt(0, "--micro-batches", parse=micro_batches_arg, metavar="{0..4}")
    """Ping-pong micro-batches (1-4); 0 chooses from measured times."""
    exchange_dtype: str = opt("same", "--exchange-dtype", choices=EXCHANGE_DTYPES)
    """How the MoE inputs cross to the FFN nodes: same (the model dtype), or fp8 (e4m3) or int8 with one
    scale per token (dynamic absmax); the results come back in the model dtype (afd.dataplane.protocol)."""
    routing: str | None = opt(None, "--routing", choices=ROUTINGS)
    """Where the router runs. attention: on the attention nodes, which send each token only to the FFN nodes
    holding its chosen experts (with the expert ids and weights), apply the identity experts themselves and
    add the FFN nodes' weighted partials; ffn: every FFN node gets every token and routes it itself (the
    broadcast). Default: attention with more than one FFN node (afd/dataplane/dispatch.py)."""
    placement: dict | None = None
    """FFN node name -> the routed experts it holds: ids and `lo-hi` ranges (ends included), a list or a
    comma-separated string (`ffn0: "0-7,12"`). An expert held by several nodes is replicated: its tokens are
    split across its live holders, and a holder's loss costs no pause (routing attention only). Default:
    contiguous ranges in node order, cut at expert-group boundaries for a group-limited router
    (afd/cluster/placement.py); `afd rebalance` writes one from measured loads."""
    zero_experts: str | None = None
    """FFN node that applies the identity experts under routing ffn; default: the first FFN node."""
    attention_tp: int = opt(1, "--attention-tp", parse=positive_int)
    """Ranks of every attention node: TP rank r of a node is its own process (`--tp-rank r`) on device
    index (the node's) + r, and exchanges its own rows with the FFN nodes (afd.model.tp)."""
    tp_comm: str = opt("allreduce", "--tp-comm", choices=TP_MODES)
    """How the TP ranks combine row-parallel results: allreduce, sp, flashcomm1 or flashcomm2."""
    flashcomm2_otp: int | None = opt(None, "--flashcomm2-otp", parse=positive_int)
    """flashcomm2's o_proj TP group size P (attention_tp > P, attention_tp % P == 0)."""
    tp_comm_min_tokens: int | None = opt(None, "--tp-comm-min-tokens")
    """Micro-batches with fewer tokens run as allreduce (counted in afd_tp_comm_fallbacks_total); default:
    the threshold of the mode (sp 1, flashcomm1/2 1001, as vllm-ascend's)."""

    kvp: int = opt(1, "--kvp", parse=positive_int)
    """KV-parallel ranks (divides attention_tp): each holds 1/kvp of every sequence's KV cache, round-robin by
    block, so max_model_len grows kvp-fold (afd/model/kvp.py)."""
    graph_mode: str | None = opt(None, "--graph-mode", choices=GRAPH_MODES)
    """eager or compile: decode micro-batches padded to engine.graph_batch_sizes run each layer's attention
    side as a compiled graph (afd/engine/graph.py; eager under attention_tp > 1), and the FFN nodes each MoE
    layer per token bucket (afd/model/ffn_graph.py; eager on CPU). Unset: the device backend's default,
    chosen by measurement (`graph_mode_default` in afd/backend/; `afd bench-graph`)."""

    @property
    def tp(self) -> TPConfig:
        return TPConfig(self.attention_tp, self.tp_comm, self.flashcomm2_otp, self.tp_comm_min_tokens, self.kvp)


@dataclass(frozen=True)
class EngineSection:
    block_size: int = opt(16, "--block-size", parse=positive_int)
    """Tokens per KV-cache block."""
    kv_cache_bytes: int = opt(256 << 20, "--kv-cache-bytes", parse=size_arg)
    """KV-cache budget of each attention rank (the YAML takes 268435456, 256MiB, 1GiB)."""
    gpu_memory_utilization: float | None = opt(None, "--gpu-memory-utilization", parse=fraction_arg)
    """vLLM's: the share of its device's memory an attention rank may fill; its KV cache takes what the weights
    leave of it, measured once they are loaded (free - (1 - share) x total: what other processes use counts).
    On CPU the memory is the RAM this process may still take (MemAvailable, within the cgroup's limit). Set,
    it replaces kv_cache_bytes."""
    max_num_seqs: int = opt(64, "--max-num-seqs", parse=positive_int)
    """Sequences per step."""
    max_num_batched_tokens: int = opt(512, "--max-num-batched-tokens", parse=positive_int)
    """Tokens per step (prefill chunks and decode tokens together)."""
    shutdown_timeout: float = opt(30.0, "--shutdown-timeout")
    """Seconds SIGTERM lets running requests finish (0 aborts them)."""
    graph_batch_sizes: tuple = GRAPH_BATCH_SIZES
    """Graph mode's batch buckets (a YAML list): a decode micro-batch of B sequences runs padded to the
    smallest bucket >= B, a larger one eager. Each bucket costs a compile (or CUDA graph memory) per
    block-table width it meets, so fewer buckets start faster and more waste less on padding."""
    compile_cache_dir: str | None = opt(None, "--compile-cache-dir")
    """Where graph mode keeps compiled graphs for the next start: inductor's caches on CPU, torchair's
    cache_compile files on NPU (CUDA graphs are captured anew each start). Unset on CPU: inductor's own
    cache (TORCHINDUCTOR_CACHE_DIR or /tmp/torchinductor_USER); unset on NPU: torchair compiles through
    torch.compile and keeps nothing for the next start."""
    speculative_tokens: int = opt(0, "--speculative-tokens", parse=speculative_count, metavar="N")
    """MTP speculative decoding: draft tokens per step from the checkpoint's MTP module (0 off, 1 or 2);
    every node reads it (FFN nodes then hold the MTP layer's experts too)."""
    enable_prefix_caching: bool = opt(True, "--enable-prefix-caching")
    """Automatic prefix caching, as vLLM's: a prompt reuses the KV blocks of the same tokens an earlier prompt
    computed (full blocks, chained hashes), kept until the cache needs the room; --no-enable-prefix-caching
    turns it off."""
    sampling_seed: int | None = opt(None, "--seed")
    """Seed of the random sampling of requests that bring no seed of their own (vLLM's --seed)."""
    enable_log_requests: bool = opt(True, "--enable-log-requests")
    """One log line per request on the attention node, vLLM's "Received request ID: params: ..." (the prompt
    and its token ids at DEBUG). On by default, as vLLM had it before 0.33 made it opt-in: a server that never
    logs a request left newcomers blind (issue 29). Off: --no-enable-log-requests, or vLLM's older
    --disable-log-requests."""


@dataclass(frozen=True)
class PrefetchSection:
    """FFN-side weight prefetch while waiting for each layer's inputs (afd.dataplane.prefetch)."""

    enabled: bool | None = None
    """Unset: the backend's default (on for Ascend NPU; off on CPU and CUDA, see docs/benchmarks.md)."""
    budget_bytes: int | None = None
    """Bytes hinted per layer. Unset (the default): computed per layer as the device's memory bandwidth x
    the measured wait for the layer's inputs, within its cache (docs/architecture/prefetch.md); set it only
    to pin the budget, e.g. to compare against the computed one. A positive size ("16MiB" or bytes)."""
    weights: list | None = None
    """Any of router (this layer's and the next's), gate_up (the chosen experts' w13 rows), down (their w2
    rows); default: all three. Hinted in the order the layer reads them, whatever the order here."""
    next_layer: bool = True
    """Also hint the next layer's router while waiting for this layer's inputs."""


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
    max_restarts: int = opt(5, "--max-restarts", parse=count_arg)
    """Restarts in a row of one node by `afd launch`, `afd serve` and afd.LLM's local cluster, which start a
    node that failed (exited non-zero, or was killed) again with its own command; past it they stop the
    cluster and exit 1 (0: never restart). A node that then stays up for startup_timeout starts a new row."""
    restart_backoff: float = opt(1.0, "--restart-backoff")
    """Seconds before the first restart of a row; each next one waits twice as long, at most 30 s."""
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
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)
    """The key paths the YAML spelled out (`engine.block_size`, `nodes.0.device`): `to_dict` writes them back
    even when they hold the default, so a file round-trips unchanged."""
    http: HttpSection = HttpSection()

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

    @property
    def routing(self) -> str:
        """layout.routing, resolved: attention by default with more than one FFN node."""
        if self.layout.routing is not None:
            return self.layout.routing
        return "attention" if len(self.ffn_nodes) > 1 else "ffn"

    def placement(self, n_routed: int, groups: int = 1) -> Placement:
        """Which experts each FFN node holds (layout.placement, or the default split); `groups`: the
        router's expert groups (ModelConfig.expert_groups), which the default cuts at."""
        ffn = [n.name for n in self.ffn_nodes]
        if self.layout.placement:
            return from_yaml(self.layout.placement, n_routed, ffn)
        return default_placement(n_routed, ffn, groups)

    def serves_zero(self, name: str) -> bool:
        """Whether FFN node `name` applies the identity experts (routing ffn: one node does; routing
        attention: the attention nodes do, and no FFN node)."""
        return self.routing == "ffn" and name == (self.layout.zero_experts or self.ffn_nodes[0].name)

    def to_dict(self) -> dict:
        """The cluster YAML of this config (what `from_dict` reads back into an equal config): every value that
        differs from its default, plus the required ones."""
        doc: dict = {}
        for key in SECTION_KEYS:
            section = _changed(getattr(self, key), key, self.given | {"model.path"})
            if section or key in self.given:
                doc[key] = section
        keep = {f"nodes.{i}.{k}" for i in range(len(self.nodes)) for k in ("name", "role", "host", "ports")}
        doc["nodes"] = [_changed(n, f"nodes.{i}", self.given | keep) for i, n in enumerate(self.nodes)]
        return doc

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @property
    def topology_name(self) -> str:
        lay = self.layout
        tp = f" (attention tp {lay.attention_tp}, {lay.tp_comm})" if lay.attention_tp > 1 else ""
        return f"{len(self.attention_nodes)}A{len(self.ffn_nodes)}F{tp}"


def _changed(obj, path: str, keep: frozenset[str] | set[str]) -> dict:
    """A section's fields at `path` that differ from their defaults or whose path is in `keep`, as YAML values."""
    out = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if f"{path}.{f.name}" in keep or value != f.default:
            if isinstance(value, Ports):
                value = {k: v for k, v in _changed(value, f"{path}.ports", keep).items() if v is not None}
            elif f.name.endswith("_bytes"):
                value = _size_text(value)
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, dict):
                value = {k: list(v) if isinstance(v, tuple) else v for k, v in value.items()}
            out[f.name] = value
    return out


def _size_text(n: int) -> int | str:
    """A byte count as the YAML writes it: in the largest binary unit that divides it, else plain."""
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n % mult == 0:
            return f"{n // mult}{unit}"
    return n
