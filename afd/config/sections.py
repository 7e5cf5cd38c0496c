"""The cluster YAML's sections other than its nodes: the model, the layout of the disaggregation, the engine,
the FFN side's weight prefetch and the cluster's own timings. Each field is documented; a field declared with
`opt(default, "--flag")` is also that command-line option (afd.config.flags) and a keyword of `afd.LLM`.
afd.config.schema assembles them with the nodes into the ClusterConfig."""

from __future__ import annotations

from dataclasses import dataclass

from afd.config.fieldspec import (
    AT_LEAST_0,
    FRACTION,
    MICRO_BATCHES,
    POSITIVE,
    SPECULATIVE,
    dtype_arg,
    opt,
    size_arg,
)
from afd.config.tp import MODES as TP_MODES
from afd.config.tp import TPConfig
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
    max_model_len: int | None = opt(None, "--max-model-len", rule=POSITIVE)
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
    micro_batches: int = opt(0, "--micro-batches", rule=MICRO_BATCHES, metavar="{0..4}")
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
    (afd/config/placement.py); `afd rebalance` writes one from measured loads."""
    zero_experts: str | None = None
    """FFN node that applies the identity experts under routing ffn; default: the first FFN node."""
    attention_tp: int = opt(1, "--attention-tp", rule=POSITIVE)
    """Ranks of every attention node: TP rank r of a node is its own process (`--tp-rank r`) on device
    index (the node's) + r, and exchanges its own rows with the FFN nodes (afd.model.tp)."""
    tp_comm: str = opt("allreduce", "--tp-comm", choices=TP_MODES)
    """How the TP ranks combine row-parallel results: allreduce, sp, flashcomm1 or flashcomm2."""
    flashcomm2_otp: int | None = opt(None, "--flashcomm2-otp", rule=POSITIVE)
    """flashcomm2's o_proj TP group size P (attention_tp > P, attention_tp % P == 0)."""
    tp_comm_min_tokens: int | None = opt(None, "--tp-comm-min-tokens")
    """Micro-batches with fewer tokens run as allreduce (counted in afd_tp_comm_fallbacks_total); default:
    the threshold of the mode (sp 1, flashcomm1/2 1001, as vllm-ascend's)."""

    kvp: int = opt(1, "--kvp", rule=POSITIVE)
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
    block_size: int = opt(16, "--block-size", rule=POSITIVE)
    """Tokens per KV-cache block."""
    kv_cache_bytes: int = opt(256 << 20, "--kv-cache-bytes", parse=size_arg)
    """KV-cache budget of each attention rank (the YAML takes 268435456, 256MiB, 1GiB)."""
    gpu_memory_utilization: float | None = opt(None, "--gpu-memory-utilization", rule=FRACTION)
    """vLLM's: the share of its device's memory an attention rank may fill; its KV cache takes what the weights
    leave of it, measured once they are loaded (free - (1 - share) x total: what other processes use counts).
    On CPU the memory is the RAM this process may still take (MemAvailable, within the cgroup's limit). Set,
    it replaces kv_cache_bytes."""
    max_num_seqs: int = opt(64, "--max-num-seqs", rule=POSITIVE)
    """Sequences per step."""
    max_num_batched_tokens: int = opt(512, "--max-num-batched-tokens", rule=POSITIVE)
    """Tokens per step (prefill chunks and decode tokens together)."""
    shutdown_timeout: float = opt(30.0, "--shutdown-timeout", rule=AT_LEAST_0)
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
    speculative_tokens: int = opt(0, "--speculative-tokens", rule=SPECULATIVE, metavar="N")
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
    logs a request left newcomers blind. Off: --no-enable-log-requests, or vLLM's older
    --disable-log-requests."""


@dataclass(frozen=True)
class PrefetchSection:
    """FFN-side weight prefetch while waiting for each layer's inputs (afd.dataplane.prefetch)."""

    enabled: bool | None = None
    """Unset: the backend's default (on for Ascend NPU; off on CPU and CUDA, see docs/benchmarks/suite.md)."""
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
    startup_timeout: float = opt(120.0, rule=POSITIVE)
    heartbeat_interval: float = opt(0.5, rule=POSITIVE)
    """A node silent for 3 of them is late: a peer that has waited on it as long drops its pair (a hang
    costs the others about 1.5 s); one silent for heartbeat_timeout is lost, whatever waits on it."""
    heartbeat_timeout: float = opt(10.0, rule=POSITIVE)
    comm_timeout: float = opt(60.0, rule=POSITIVE)
    rejoin_timeout: float = opt(60.0, rule=AT_LEAST_0)
    """Seconds the surviving nodes wait, their requests paused, for a failed node's replacement to
    register (the same command started again); 0 fails the requests at once."""
    max_restarts: int = opt(5, "--max-restarts", rule=AT_LEAST_0)
    """Restarts in a row of one node by `afd launch`, `afd serve` and afd.LLM's local cluster, which start a
    node that failed (exited non-zero, or was killed) again with its own command; past it they stop the
    cluster and exit 1 (0: never restart). A node that then stays up for startup_timeout starts a new row."""
    restart_backoff: float = opt(1.0, "--restart-backoff", rule=AT_LEAST_0)
    """Seconds before the first restart of a row; each next one waits twice as long, at most 30 s."""
    tls: dict | None = None
    """Optional {cert, key, ca} file paths for the control plane."""
    insecure: bool = False
    """Let nodes whose host is not loopback start without AFD_CLUSTER_TOKEN (an open control plane)."""
    share_devices: bool = False
    """Let nodes share a CUDA device (a cluster on one GPU, for testing): each process on a shared device gets
    an NCCL_HOSTID of its own, so that NCCL, which refuses two ranks of one host on one GPU, connects them as two
    hosts, over sockets. Slower than P2P, and the nodes split the GPU's memory. HCCL has no such override."""
