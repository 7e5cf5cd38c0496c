"""The device interface: everything device-specific that afd's model, runner and transport use."""

from __future__ import annotations

import sys
import time
import types
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from afd.backend import host_syncs
from afd.backend.devices import DeviceUnavailable  # noqa: F401 (the backends raise it)

if TYPE_CHECKING:
    from afd.quant.scheme import QuantSpec
from afd.backend.mla_prolog import MLAProlog, MLAPrologWeights


def group_slices(group_sizes: torch.Tensor) -> Iterator[tuple[int, slice]]:
    """(group, its contiguous row slice) of each non-empty group, the sizes read on the host."""
    start = 0
    for g, n in enumerate(host_syncs.to_list(group_sizes)):
        if n:
            yield g, slice(start, start + n)
            start += n


def grouped_matmul_by_slices(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """One GEMM per non-empty group over its contiguous row slice of x (reads the sizes on the host); rows
    past the groups are left as they come."""
    out = x.new_empty(x.shape[0], w.shape[-1])
    for g, rows in group_slices(group_sizes):
        torch.mm(x[rows], w[g], out=out[rows])
    return out


def quant_grouped_matmul_by_slices(x, q, scale, group_sizes, spec, matmul=None) -> torch.Tensor:
    """grouped_matmul_by_slices with a quantized weight (q [G, N, K], scale [G, N, Kb]): `matmul(x, q[g],
    scale[g], spec)` (default: afd.quant.reference's) per non-empty group; reads the sizes on the host."""
    from afd.quant import reference

    matmul = matmul or reference.quant_matmul
    out = x.new_empty(x.shape[0], q.shape[1])
    for g, rows in group_slices(group_sizes):
        out[rows] = matmul(x[rows], q[g], scale[g], spec)
    return out


def sizes_covering(group_sizes: torch.Tensor, rows: int) -> torch.Tensor:
    """group_sizes [G] with the rows past them (rows - their sum) added to the last group, on the device: for
    a fused grouped GEMM whose documented contract wants the groups to cover x's rows."""
    return torch.cat([group_sizes[:-1], (rows - group_sizes[:-1].sum()).reshape(1)])


HOST_SYNCS = ("item", "tolist", "_local_scalar_dense")
"""What reads a device value on the host (dynamo traces .item() into a graph rather than breaking it)."""


def refuse_host_syncs(compiler):
    """A torch.compile backend: the graph dynamo hands over, refused if it reads a value on the host (a sync
    inside the compiled region, and an error under CUDA-graph capture), else compiled by `compiler` (a
    backend or its registered name)."""

    def backend(gm: torch.fx.GraphModule, example_inputs):
        syncs = [
            str(n.target)
            for n in gm.graph.nodes
            if n.op in ("call_method", "call_function") and set(str(n.target).split(".")) & set(HOST_SYNCS)
        ]
        if syncs:
            raise RuntimeError(f"a host sync in the graph: {', '.join(syncs)}")
        inner = torch._dynamo.lookup_backend(compiler) if isinstance(compiler, str) else compiler
        return inner(gm, example_inputs)

    return backend


def named_method(obj, name: str, body):
    """body(obj, *args) as a bound method of obj with a code object of its own, named `name`: compilers cache
    per code object (dynamo's guards, torchair's cache_compile files), so each graph of Backend.compile gets
    one, always called with one input signature."""

    def step(self, *args):
        return body(self, *args)

    code = step.__code__.replace(co_name=name)
    if sys.version_info >= (3, 11):  # compilers read the qualified name too
        code = code.replace(co_qualname=name)
    return types.MethodType(types.FunctionType(code, step.__globals__, name, None, step.__closure__), obj)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` on `device`, without a host sync: a copy from pageable memory, or one that is not
    non_blocking, makes the host wait for the stream (PyTorch's copy_kernel_cuda synchronizes after it; CUDA
    stages pageable memory through a sync). Staged through pinned memory from PyTorch's caching host
    allocator, which keeps the block until the copy has run."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def copy_to_device(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst.copy_(src) for a host `src`, without a host sync where dst is on a device (see to_device)."""
    if dst.device.type == "cpu":
        return dst.copy_(src)
    return dst.copy_(src.pin_memory(), non_blocking=True)


def bind_device(device: torch.device) -> None:
    """The calling thread's current device becomes `device` (nothing to do on CPU)."""
    if device.type != "cpu":
        getattr(torch, device.type).set_device(device)


class HostEvent:
    """A point on the host's clock, with a device timing event's interface (record, query, elapsed_time in
    ms): where ops run synchronously, as on CPU, the host's time is the device's."""

    def __init__(self):
        self.t: float | None = None

    def record(self) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return self.t is not None

    def elapsed_time(self, end: HostEvent) -> float:
        if self.t is None or end.t is None:
            raise RuntimeError("both events must be recorded")
        return (end.t - self.t) * 1000.0


class PeerError(RuntimeError):
    """A peer process went away, timed out, or broke the protocol: on the data plane (afd.dataplane) or in
    an attention node's TP group (afd.model.tp). Here, below both, so that one except clause (the engine's
    re-forming) covers every process boundary."""

    made = 0
    """How many were made in this process. A data plane that saw one made since it formed tears down by
    aborting (afd.dataplane.transport): a failed TP collective may be queued on a group of its world."""

    def __init__(self, message: str, peer: int | None = None):
        super().__init__(message)
        self.peer = peer
        PeerError.made += 1


@dataclass(frozen=True)
class PrefetchSpec:
    """What bounds a weight prefetch on one device (docs/design/longcat-on-ascend.md#weight-prefetch: the bytes
    a gap can move are bandwidth x time, and only what the cache holds survives until the compute reads it)."""

    bandwidth: float
    """Bytes per second the prefetch can move from memory (HBM on a device, DRAM on a CPU)."""
    cache_bytes: int
    """The cache the prefetch fills: L2 on Ascend, the last-level cache on a CPU."""
    source: str
    """Where the two figures come from (measured, read from the OS, or a document): logged at startup."""


class Backend(ABC):
    """One device family. Implementations import their SDKs lazily, inside their own module."""

    name: str
    dist_backend: str
    """torch.distributed backend for the data plane: gloo, nccl or hccl."""

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    def synchronize(self) -> None:
        """Wait for all queued device work (no-op where ops are synchronous)."""

    def timing_event(self):
        """An event that times device work without a host sync: record() on the current stream, then, once
        query() is True, start.elapsed_time(end) in ms (torch.cuda.Event / torch.npu.Event with timing)."""
        return HostEvent()

    def bind_thread(self) -> None:
        """Make this node's device the calling thread's current device. The current device is per
        thread on CUDA and on Ascend (aclrtSetDevice binds the calling thread), so every thread that
        issues device work calls this first; otherwise implicit-device calls act on device 0."""
        bind_device(self.device)

    shutdown_waits_for_queued_work: bool = False
    """Whether tearing a process group down (c10d's `shutdown()`, which `destroy_process_group` calls on
    every group) waits for the work queued on it: NCCL's finalizes each communicator and waits for its
    kernels, HCCL's synchronizes the group's streams. A send or receive whose peer is dead never
    finishes, so there the data plane aborts (`abort_group`) instead whenever work may be queued. gloo's
    shutdown does not wait."""

    def abort_group(self, pg) -> None:
        """Abort the communicators of process group `pg` without waiting for the work queued on them;
        callable from any thread, also while another thread waits on `pg`. c10d's registry of groups is
        left alone (the owner forgets the group later, on its own thread); the data plane's own flag refuses
        the pair's later ops. gloo, which has no such abort, shuts the group's connections down
        (afd.backend.gloo_pairs)."""

    def pair_group(self, store, rank: int, timeout: timedelta, group_id: str):
        """A standalone two-rank process group of this backend over `store` (rank 0 or 1), outside c10d's
        registry and without a default group: one attention/FFN pair's own world (afd.dataplane.pairs), so
        that a pair forms and re-forms without any other process taking part. group_id: this group's own
        name, unique among the process's groups (HCCL keys communicators by it); the group's own send/recv
        need no default group."""
        raise NotImplementedError(f"the {self.name} backend forms no pair groups")

    stream_ordered_waits: bool = False
    """Whether the data plane's waits order the consumer's stream after the transfer without blocking the
    host (NCCL, HCCL), its deadlines then held by a watchdog (afd.backend.deadlines); else a wait blocks
    the host until the transfer is done or the group's timeout passes (gloo)."""

    def shared_device_env(self, identity: str) -> dict[str, str] | None:
        """The environment under which a process of node `identity` may share its device with another node's
        (cluster.share_devices), set before its first communicator forms; None: this backend cannot."""
        return None

    def comm_env(self) -> dict[str, str]:
        """Environment variables the data plane needs before its process group forms (so that every
        wait's timeout holds); checked and set by afd.dataplane.transport."""
        return {}

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        return (0, 0)

    @abstractmethod
    def grouped_matmul(self, x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        """x [T, K] with rows sorted by group; w [G, K, N]; group_sizes [G] int64 row counts on x's device
        (they stay there: a device backend never reads them on the host), summing to T or less. Returns
        [T, N], group g's rows times w[g]; rows past the groups are unspecified (the caller drops them: they
        let its shapes depend on T alone)."""

    def quant_matmul(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
        """x [T, K] (the model dtype) @ the quantized weight (q [N, K] int8 or float8_e4m3fn, scale fp32 [N, Kb]:
        afd.quant.formats)^T -> [T, N] in x's dtype, the activations quantized per token as `spec` says.
        Default: afd.quant.reference (widen and multiply in fp32), which the fused kernels are held to."""
        from afd.quant import reference

        return reference.quant_matmul(x, q, scale, spec)

    def quant_grouped_matmul(
        self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group_sizes: torch.Tensor, spec: QuantSpec
    ) -> torch.Tensor:
        """grouped_matmul's contract with a quantized weight: q [G, N, K], scale [G, N, Kb] (the experts'
        checkpoint orientation). Default: quant_matmul per group, reading the sizes on the host."""
        return quant_grouped_matmul_by_slices(x, q, scale, group_sizes, spec, self.quant_matmul)

    def check_quantization(self, spec: QuantSpec) -> None:
        """Refuse, naming the setting, a scheme this device cannot run (an FP8 checkpoint on a GPU without FP8,
        a block size the kernel refuses); log once which kernel each GEMM takes. Default: the reference
        kernels run anywhere."""

    def grouped_matmul_in_graph(self, w: torch.Tensor) -> bool:
        """Whether grouped_matmul(x, w, sizes) keeps the sizes on the device for x of w's dtype, so that a
        device graph can hold it (afd.model.ffn_graph); where it reads them on the host, a CUDA graph's capture
        fails and a torchair graph breaks."""
        return not self.group_sizes_on_host

    prefetch_by_default: bool = False
    """Whether FFN nodes prefetch weights unless the YAML says otherwise (see docs/benchmarks/suite.md)."""

    def prefetch(
        self, weight: torch.Tensor, max_bytes: int, dependency: torch.Tensor | None = None, offset: int = 0
    ) -> int:
        """Hint that `max_bytes` of `weight` from byte `offset` on (one expert's slice of a stacked weight)
        are needed soon, once `dependency` is computed (inside a graph: the node it follows); returns the
        bytes hinted (0: no-op). No numerical effect."""
        return 0

    def prefetch_spec(self) -> PrefetchSpec | None:
        """The figures the FFN node sizes its prefetch by (afd.dataplane.prefetch_budget); None where
        prefetch is a no-op."""
        return None

    group_sizes_on_host: bool = False
    """Whether grouped_matmul reads its group sizes on the host anyway (grouped_matmul_by_slices): then the
    experts the router chose are known there at no extra sync, and can be hinted before the GEMMs."""

    def mm_reduce_scatter(self, x: torch.Tensor, weight: torch.Tensor, group, world_size: int) -> torch.Tensor | None:
        """Fused (x @ weight^T) then ReduceScatter over `group` along rows: x [T, K] (T a multiple of
        world_size), weight [N, K] -> [T / world_size, N]; None where the device has no fused kernel (the
        caller then runs matmul and reduce_scatter)."""
        return None

    def moe_gating_top_k(
        self,
        logits: torch.Tensor,
        k: int,
        *,
        bias: torch.Tensor | None,
        sigmoid: bool,
        groups: int = 1,
        keep_groups: int = 1,
        renormalise: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A router's top-k as one fused op: logits [T, E] -> scores = sigmoid (else softmax over E) in fp32;
        experts chosen on scores + bias [E] (optional), first keeping the keep_groups best of `groups` equal
        groups, each scored by the sum of its top 2; weights [T, K] = the chosen experts' unbiased scores,
        divided by (their sum + 1e-20) if `renormalise`, times `scale`, in logits' dtype; ids [T, K] int64.
        None where the device has no fused op for these arguments: the router then runs plain torch."""
        return None

    def paged_mla_decode(
        self,
        q_lat: torch.Tensor,
        q_rope: torch.Tensor,
        kv_c: torch.Tensor,
        kv_r: torch.Tensor,
        block_tables: torch.Tensor,
        ctx_lens: list[int] | None,
        scale: float,
    ) -> torch.Tensor | None:
        """MLA's absorbed decode attention in one fused kernel over the paged cache: q_lat [B, N, C] (queries
        absorbed into latent space), q_rope [B, N, R]; kv_c [nb, bs, C] and kv_r [nb, bs, R] the latent and
        rope caches; block_tables [B, nb'] block ids on the device; ctx_lens the B context lengths as host ints
        (None inside a compiled graph). Returns o_lat [B, N, C] = softmax((q_lat . c + q_rope . k_rot) * scale)
        @ c, or None where the device has no fused kernel for these inputs (the caller then reads the cache
        itself, afd/model/paged_attention.py)."""
        return None

    def mla_prolog(self, layer: MLAPrologWeights) -> MLAProlog | None:
        """Called once per MLA layer at load (after any TP cut): the device's fused prolog for its decode steps
        (the projections, norms, rope and absorption before attention, and the cache write), with whatever
        weights it needs prepared now; None where there is none for this layer (MLA then projects itself)."""
        return None

    graph_mode_default: str = "eager"
    """layout.graph_mode when the YAML leaves it unset (afd.engine.graph); each backend's by measurement."""

    capture_at_warmup: bool = False
    """Whether graph mode compiles every graph a node can meet before it serves (afd.engine.graph_warmup)
    rather than on first use, one per step. Where a compile drains the device or takes long (a CUDA graph
    capture syncs the device and flushes the caching allocator; a torchair GE compile takes seconds), doing
    it inside a live decode step stalls the step and the FFN nodes waiting on it. CPU: lazily, since an
    inductor compile of every bucket and width would cost minutes before the first token."""

    def compile(self, fn, cache_dir: str | None = None):
        """`fn` as the device's static graph, compiled (or loaded from `cache_dir`) on its first call. afd.engine
        .graph calls it with one bound method of an nn.Module per graph, each with a code object of its own,
        always called with the same input shapes, dtypes and non-tensor values. Identity by default."""
        return fn
