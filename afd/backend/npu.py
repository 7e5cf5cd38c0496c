"""The Ascend backend: HCCL data plane (its own streams, ordered by ProcessGroupHCCL), torch_npu fused
MoE ops, torchair graphs.

torch_npu and torchair are imported here only, when the backend is constructed: importing afd on a
machine without them never fails.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from afd.backend import host_syncs, npu_attention, npu_prolog, npu_quant, sync_watch
from afd.backend.base import Backend, DeviceUnavailable, PrefetchSpec, grouped_matmul_by_slices, sizes_covering
from afd.backend.devices import check_indices
from afd.backend.npu_mmrs import MMRS_COMM_MODE, mmrs_fits, takes_argument
from afd.backend.npu_quant import GMM_INNER_LIMIT, GMM_MAX_GROUPS

log = logging.getLogger("afd.backend")


def _import_torch_npu():
    try:
        import torch_npu  # noqa: F401  (registers the "npu" device with torch)
    except ImportError as e:
        raise DeviceUnavailable(f"device npu: torch_npu is not importable ({e})") from None
    return torch_npu


# The figures the FFN node's prefetch budget is sized by on Ascend (afd.dataplane.prefetch_budget).
ASCEND_HBM_BANDWIDTH = 1.6e12
"""Bytes/s of one Ascend 910B-class die's HBM (Atlas A2; an A3 module is two such dies, each its own device)."""
ASCEND_L2_BYTES = 192 << 20
"""One 910B-class die's L2 cache."""
ASCEND_FIGURES_SOURCE = "910B figures, unverified: docs/architecture/prefetch.md"
"""Unverified: the widely quoted figures for the Ascend 910B (HBM2e about 1.6 TB/s, L2 192 MB); the stored
Huawei pages this was written from (CANN Ascend C best practices, "Setting a Proper L2 CacheMode", 8.5.0)
say only that L2 is several times faster than GM, with no size. A device run should log the L2 that
torch_npu reports (prefetch_spec prefers it) and replace these with a cited figure."""


class NpuBackend(Backend):
    name = "npu"
    dist_backend = "hccl"
    # On by default: the LongCat-Flash recipe on Atlas A3 prefetches the FFN side's GMM weights in the
    # communication gaps (docs/design/longcat-on-ascend.md#ffn-prefetch); this suite cannot run there.
    prefetch_by_default = True

    def __init__(self, index: int = 0):
        self._torch_npu = _import_torch_npu()
        check_indices("npu", [index], torch.npu.device_count())  # one line, not set_device's traceback
        self._device = torch.device("npu", index)
        self.bind_thread()
        sync_watch.from_env(torch.npu.set_sync_debug_mode)  # AFD_SYNC_WATCH: the runtime's own sync count

    @property
    def device(self) -> torch.device:
        return self._device

    # Without blocking wait, WorkHCCL's wait() only makes the current stream wait for the work (no host block),
    # and its timeout does not apply: afd's watchdog (afd/backend/deadlines.py) aborts the pair when a
    # deadline passes. source: Ascend/pytorch torch_npu/csrc/distributed/ProcessGroupHCCL.hpp
    # (TORCH_HCCL_BLOCKING_WAIT = {"TORCH_HCCL_BLOCKING_WAIT", "HCCL_BLOCKING_WAIT"}; HCCL_ASYNC_ERROR_HANDLING)
    # and ProcessGroupHCCL.cpp WorkHCCL::synchronizeInternal, master @9e73e70 (2026-08).
    def comm_env(self) -> dict[str, str]:
        # stream-ordered waits and afd's watchdog, as on CUDA (older torch_npu reads HCCL_BLOCKING_WAIT)
        return {"TORCH_HCCL_BLOCKING_WAIT": "0", "HCCL_BLOCKING_WAIT": "0", "HCCL_ASYNC_ERROR_HANDLING": "0"}

    stream_ordered_waits = True

    # ProcessGroupHCCL::shutdown() (what destroy_process_group calls) synchronizes every HCCL stream of the
    # group before it destroys the communicators: a send or receive whose peer is dead blocks it, up to
    # HCCL_EXEC_TIMEOUT. pg.abort() does nothing here: ProcessGroupHCCL declares `bool abort(optional<string>)`,
    # which does not override c10d's `void abort()` (a no-op, pytorch torch/csrc/distributed/c10d/Backend.hpp).
    # The abort torch_npu binds is `abort_hccl_comm(abortReason)` = ProcessGroupHCCL::abortAndClearHcclComm:
    # every communicator of the group destroyed (hcclCommDestroy), no stream synchronized, the maps cleared;
    # torch_npu's own reinit_process_group calls it as below. source: Ascend/pytorch
    # torch_npu/csrc/distributed/ProcessGroupHCCL.cpp (::shutdown, ::abortAndClearHcclComm, abortCommsFromMap),
    # ProcessGroupHCCL.hpp, Init.cpp (.def("abort_hccl_comm", ...)), torch_npu/distributed/distributed_c10d.py
    # (reinit_process_group), master @9e73e70; abort_hccl_comm is bound since v6.0.0 (2024-09).
    shutdown_waits_for_queued_work = True

    def abort_group(self, pg) -> None:
        # A pair's group is the HCCL backend itself (pair_group), a c10d Backend: it has no _get_backend,
        # which only the ProcessGroup wrapper of a registered group has (TP groups, _hcom_name below).
        pg.abort_hccl_comm("afd: data plane abort")

    def pair_group(self, store, rank: int, timeout: timedelta, group_id: str):
        """torch_npu's ProcessGroupHCCL(store, rank, size, options), a c10d Backend, built as the wheel's own
        registry helper builds a registered group's (torch_npu 2.14.0 wheel: torch_npu/_init/registry/
        distributed.py, _new_process_group_hccl_helper; the class is reached only as
        torch_npu._C._distributed_c10d.ProcessGroupHCCL, nothing in the wheel sets
        torch.distributed.ProcessGroupHCCL). Its communicators form at the first op (getHCCLComm), per pair.
        group_id: with RANK_TABLE_FILE set, torch_npu derives point-to-point communicators from a group keyed
        by its id, so every pair group names itself (an empty id, shared by all, would let one pair's
        communicator derive from another's)."""
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        opts = ProcessGroupHCCL.Options()
        opts._timeout = timeout
        opts.is_high_priority_stream = False  # as the helper sets it for every registered group
        opts.group_id = group_id  # global_ranks_in_group stays empty: a pair's ranks are in no rank table
        return ProcessGroupHCCL(store, rank, 2, opts)

    def synchronize(self) -> None:
        host_syncs.note(self._device)
        torch.npu.synchronize(self._device)

    def timing_event(self):
        return torch.npu.Event(enable_timing=True)

    def memory_info(self) -> tuple[int, int]:
        return torch.npu.mem_get_info(self._device)

    def grouped_matmul_in_graph(self, w: torch.Tensor) -> bool:
        groups, k_dim, n_dim = w.shape  # outside the fused op's limits grouped_matmul reads the sizes
        return groups <= GMM_MAX_GROUPS and max(k_dim, n_dim) < GMM_INNER_LIMIT

    def grouped_matmul(self, x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        groups, k_dim, n_dim = w.shape
        if groups == 1:  # group_list_type=1 refuses a group list of length 1: an FFN node with one expert
            return torch.mm(x, w[0])
        if groups > GMM_MAX_GROUPS or max(k_dim, n_dim) >= GMM_INNER_LIMIT or x.shape[0] == 0:
            # Outside the fused op's documented limits (no model afd serves comes near them): correct, but
            # it reads the group sizes on the host.
            return grouped_matmul_by_slices(x, w, group_sizes)
        # split_item=2: one output tensor; group_type=0: groups along M; group_list_type=1: counts, int64,
        # kept on the device (no host read, nothing for a torchair graph to break on). Counts must sum to x's
        # rows (aclnnGroupedMatmulV4 constraints, group type 0, single-single-single; op-plugin 7.1.0): the
        # rows past the groups join the last one, which computes them for nothing (a few hundred rows at
        # decode, against one expert's weight read) and the caller drops.
        counts = sizes_covering(group_sizes.to(torch.int64), x.shape[0])
        (y,) = self._torch_npu.npu_grouped_matmul(
            [x], [w], group_list=counts, split_item=2, group_type=0, group_list_type=1
        )
        return y

    # --quantization w8a8 / w8a16 on torch_npu's quantized ops; fp8 refused (afd/backend/npu_quant.py, with sources).
    def check_quantization(self, spec) -> None:
        log.info("quantization %s; its GEMMs on NPU: %s", spec.describe(), npu_quant.check(spec))

    def quant_matmul(self, x, q, scale, spec):
        return npu_quant.quant_matmul(self._torch_npu, x, q, scale, spec, self._say_once)

    def quant_grouped_matmul(self, x, q, scale, group_sizes, spec):
        return npu_quant.quant_grouped_matmul(self._torch_npu, x, q, scale, group_sizes, spec, self._say_once)

    def mm_reduce_scatter(self, x: torch.Tensor, weight: torch.Tensor, group, world_size: int) -> torch.Tensor | None:
        op = self._mmrs_op()
        if op is None or not mmrs_fits(x, weight, world_size):
            return None
        # x2 is (k, n): nn.Linear's (n, k) weight, transposed as a view, which the doc allows for x2 (not for
        # input, which must be a plain ND tensor: .contiguous() is a no-op for row_parallel's padded rows).
        # bias=None: "aiv" takes no bias (the caller adds it); reduce_op "sum" and comm_turn 0 are the only values.
        # Not gated on size: vllm-ascend turned the fusion off for MoE models, whose SP shards from 1 token, after
        # measuring it slower on small shapes (vllm-ascend #3834); its dense models fuse only above 1000 tokens.
        return op(
            x.contiguous(),
            weight.t(),
            self._hcom_name(group),
            world_size,
            reduce_op="sum",
            bias=None,
            comm_turn=0,
            comm_mode=MMRS_COMM_MODE,
        )

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
        # torch_npu.npu_moe_gating_top_k where the router's math and the op's documented limits agree
        # (afd.backend.npu_gating, with the sources); its ids are int32, afd's int64.
        from afd.backend.npu_gating import gating_args

        op = getattr(self._torch_npu, "npu_moe_gating_top_k", None)
        args = gating_args(logits, k, bias, sigmoid, groups, keep_groups, renormalise)
        if op is None or args is None:
            return None
        weights, ids, _ = op(logits, k, routed_scaling_factor=scale, **args)
        return weights, ids.long()

    def _mmrs_op(self):
        """torch_npu.npu_mm_reduce_scatter_base where it takes comm_mode (op-plugin 7.2.0 and later), else None."""
        if "_mmrs" not in self.__dict__:
            op = getattr(self._torch_npu, "npu_mm_reduce_scatter_base", None)
            self._mmrs = op if takes_argument(op, "comm_mode") else None
        return self._mmrs

    def _hcom_name(self, group) -> str:
        """The communicator name the op takes as `hcom`, the documented way (doc example, and op-plugin's own
        test, test_mm_reduce_scatter_base.py): group._get_backend(npu).get_hccl_comm_name(rank). torch_npu uses
        rankid only to warn when rankid % device_count is not the current device (ProcessGroupHCCL.cpp,
        getHcclCommName); vllm-ascend passes the rank in the TP group, as here. The first call creates the
        group's communicator for the current device if no collective has: every rank reaches it together, since
        the TP ranks run each layer in lockstep. Cached per group."""
        names = self.__dict__.setdefault("_hcom_names", {})
        if group not in names:
            names[group] = group._get_backend(torch.device("npu")).get_hccl_comm_name(dist.get_rank(group))
        return names[group]

    def paged_mla_decode(self, q_lat, q_rope, kv_c, kv_r, block_tables, ctx_lens, scale):
        # npu_fused_infer_attention_score's MLA mode where its documented limits hold (afd/backend/npu_attention.py),
        # else None with the reason logged once.
        why = npu_attention.refusal(q_lat, q_rope, kv_c, kv_r, ctx_lens)
        if why is not None:
            self._say_once("MLA decode reads the paged cache without npu_fused_infer_attention_score: %s", why)
            return None
        assert ctx_lens is not None  # refusal() says None otherwise
        return npu_attention.mla_decode(self._torch_npu, q_lat, q_rope, kv_c, kv_r, block_tables, ctx_lens, scale)

    def mla_prolog(self, layer):
        # npu_mla_prolog_v3 where the layer fits its documented limits (afd/backend/npu_prolog.py), its weights
        # prepared now; else None, the reason logged once (every layer of a model has the same one).
        without = "MLA decode projects without npu_mla_prolog_v3: %s"
        why = npu_prolog.refusal(self._torch_npu, layer)
        if why is not None:
            self._say_once(without, why)
            return None
        return npu_prolog.NpuMLAProlog(self._torch_npu, layer, lambda why: self._say_once(without, why))

    def _say_once(self, message: str, why: str) -> None:
        """log.info(message % why), once per backend for each (message, why)."""
        seen = self.__dict__.setdefault("_said", set())
        if (message, why) not in seen:
            seen.add((message, why))
            log.info(message, why)

    def prefetch(
        self, weight: torch.Tensor, max_bytes: int, dependency: torch.Tensor | None = None, offset: int = 0
    ) -> int:
        # npu_prefetch(input, dependency, max_size, offset=0): an L2 hint of max_size bytes from byte `offset`
        # of `input`, started after `dependency`'s producer. One expert's slice of a stacked weight is the
        # whole tensor with that slice's offset, as the doc's signature has it (no view, no host read).
        # Graph mode (torchair) refuses dependency=None, so one is always passed: without a caller's choice,
        # the weight itself. The doc makes `dependency` only the node the prefetch starts after, read for
        # ordering, not data ("不做数据处理，与数据类型和数据格式无关"); the weight is already the prefetch's
        # input, so ordering after it adds no edge beyond that one: the hint may start as soon as the weight
        # exists, which is what an eager call with None does. max_size must be > 0 and offset inside the
        # tensor (the kernel's check), hence the n > 0 guard; n never runs past the tensor's end.
        # source: torch_npu.npu_prefetch, https://github.com/Ascend/op-plugin/blob/7.1.0/docs/context/
        #   torch_npu-npu_prefetch.md, op-plugin 7.1.0; torchair npu_prefetch converter,
        #   https://github.com/Ascend/torchair/blob/7.1.0/python/torchair/_ge_concrete_graph/ge_converter/
        #   custom/npu_prefetch.py, torchair 7.1.0
        n = min(max_bytes, weight.numel() * weight.element_size() - offset)
        if n > 0:
            self._torch_npu.npu_prefetch(weight, weight if dependency is None else dependency, n, offset)
        return max(n, 0)

    def prefetch_spec(self) -> PrefetchSpec:
        # L2 from the device where torch_npu reports it (NPUDeviceProperties.L2_cache_size in the releases
        # that have it), else the figure below; the bandwidth is the figure below (no API reports it).
        props = torch.npu.get_device_properties(self._device)
        l2 = int(getattr(props, "L2_cache_size", 0) or 0)
        l2_from = "reported by torch_npu" if l2 else "assumed"
        l2 = l2 or ASCEND_L2_BYTES
        hbm = f"HBM {ASCEND_HBM_BANDWIDTH / 1e12:.1f} TB/s assumed"
        return PrefetchSpec(ASCEND_HBM_BANDWIDTH, l2, f"L2 {l2 >> 20} MiB {l2_from}, {hbm} ({ASCEND_FIGURES_SOURCE})")

    graph_mode_default = "eager"
    """Not measured: afd's torchair graphs have run on the fake torchair only. The LongCat-Flash recipe on
    Atlas A3 finds decode faster as a static torchair graph (docs/design/longcat-on-ascend.md#graph-mode), so
    `compile` is expected to win; it becomes the default once an Ascend run holds it."""

    # torchair compiles (GE) or loads (cache_compile) a graph on its first call: seconds per graph, which
    # a decode step would otherwise wait for while the FFN nodes wait on it.
    capture_at_warmup = True

    def compile(self, fn, cache_dir: str | None = None):
        # torchair's GE graph (CompilerConfig's default mode, max-autotune), static shapes, as the LongCat-Flash
        # recipe compiles its decode step (docs/design/longcat-on-ascend.md#compile-cache): with a cache_dir,
        # through torchair.inference.cache_compile (dynamic=False, ge_cache=True, the recipe's arguments), which
        # saves the compiled graph for the next start. cache_compile takes only a bound method of an nn.Module and
        # keeps one graph per method's code object: a second graph (a recompile) is not cached, and a cached graph
        # is loaded and run without dynamo's guards. afd.engine.graph therefore makes one method per graph, always
        # called with one input signature.
        # source: torchair/inference/_cache_compiler.py (cache_compile, ModelCacheSaver.save_compiled_fn,
        #   CompiledModel.rebase), https://github.com/Ascend/torchair, read at 0208753d; cache_compile doc,
        #   https://www.hiascend.com/document/detail/zh/Pytorch/710/modthirdparty/torchairuseguide/torchair_00081.html
        import torchair  # after torch_npu, as torchair requires

        config = torchair.CompilerConfig()
        if cache_dir is not None and isinstance(getattr(fn, "__self__", None), torch.nn.Module):
            return torchair.inference.cache_compile(
                fn, config=config, dynamic=False, cache_dir=cache_dir, ge_cache=True, fullgraph=True
            )
        return torch.compile(
            fn, backend=torchair.get_npu_backend(compiler_config=config), dynamic=False, fullgraph=True
        )
