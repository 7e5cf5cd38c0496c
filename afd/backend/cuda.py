"""The CUDA backend: NCCL data plane (its own streams, ordered by ProcessGroupNCCL), torch._grouped_mm for experts."""

from __future__ import annotations

from datetime import timedelta

import torch

from afd.backend import host_syncs, sync_watch
from afd.backend.base import Backend, DeviceUnavailable, grouped_matmul_by_slices, sizes_covering
from afd.backend.devices import check_indices


class CudaBackend(Backend):
    name = "cuda"
    dist_backend = "nccl"

    def __init__(self, index: int = 0):
        if not torch.cuda.is_available():
            raise DeviceUnavailable(
                f"device cuda: no CUDA device is visible (torch {torch.__version__}: "
                "torch.cuda.is_available() is False)"
            )
        check_indices("cuda", [index], torch.cuda.device_count())  # one line, not set_device's traceback
        self._device = torch.device("cuda", index)
        self.bind_thread()
        sync_watch.from_env(torch.cuda.set_sync_debug_mode)  # AFD_SYNC_WATCH: the runtime's own sync count

    @property
    def device(self) -> torch.device:
        return self._device

    # Without blocking wait, WorkNCCL::wait only makes the current stream wait for the work (no host block);
    # a dead peer would then hang the next host read, so afd's watchdog (afd/backend/deadlines.py) aborts
    # the pair when a deadline passes. TORCH_NCCL_ASYNC_ERROR_HANDLING is off, since PyTorch's own watchdog
    # (mode 3 by default) would tear the process down instead of letting it re-form. source: pytorch
    # torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp (WorkNCCL::synchronize, the watchdog) and
    # ProcessGroupNCCL.hpp (TORCH_NCCL_ASYNC_ERROR_HANDLING modes 0-3), torch 2.4-2.13.
    # PyTorch's monitor is off too: on any error its watchdog sees, TORCH_NCCL_DUMP_ON_TIMEOUT writes a dump
    # signal into the group's store, here the FFN node's rendezvous store that every pair of the node shares,
    # and each process's monitor (TORCH_NCCL_ENABLE_MONITORING) then terminates it after
    # TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: one failed pair would kill the healthy ones. TORCH_NCCL_PROPAGATE_ERROR
    # (errors sent to every rank through the store) stays off for the same reason. source: the installed
    # torch's include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp (tests/test_comm_env.py reads it).
    def shared_device_env(self, identity: str) -> dict[str, str]:
        # NCCL refuses two ranks on one GPU of one host ("Duplicate GPU detected", init.cc), judging the host by
        # a hash of the hostname, or of NCCL_HOSTID where set (getHostHash, misc/utils.cc). Two host ids make
        # the ranks two hosts: P2P and SHM need one host, so the pair connects through the network transport
        # (sockets, on the loopback interface where there is no other).
        return {"NCCL_HOSTID": f"afd-{identity}"}

    def comm_env(self) -> dict[str, str]:
        return {
            "TORCH_NCCL_BLOCKING_WAIT": "0",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
            "TORCH_NCCL_ENABLE_MONITORING": "0",
            "TORCH_NCCL_PROPAGATE_ERROR": "0",
        }

    stream_ordered_waits = True

    # ProcessGroupNCCL::shutdown() (what destroy_process_group calls) finalizes every communicator and waits
    # for its kernels; ProcessGroupNCCL::abort() runs ncclCommAbort, which ends them at once ("abort() will
    # signal communicators to terminate all NCCL kernels immediately; shutdown() will wait for all NCCL
    # kernels to finish before destroying communicators"). c10d's ProcessGroup::abort reaches it, as
    # torch.distributed.distributed_c10d._abort_process_group does before it forgets the group. An aborted
    # communicator reports ncclSystemError from then on, so a wait on one of its works (another thread's,
    # blocking) fails at once. source: pytorch torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp
    # (ProcessGroupNCCL::abort, ::shutdown), NCCLUtils.cpp (NCCLComm::abort: "Set an appropriate error so that
    # we avoid using the communicator") and torch/distributed/distributed_c10d.py (_abort_process_group,
    # destroy_process_group), torch 2.5-2.13.
    shutdown_waits_for_queued_work = True

    def abort_group(self, pg) -> None:
        pg.abort()

    def pair_group(self, store, rank: int, timeout: timedelta, group_id: str):
        """ProcessGroupNCCL(store, rank, size, options) with the options' `_timeout` (pytorch
        torch/csrc/distributed/c10d/init.cpp, ProcessGroupNCCL's binding and Options; torch 2.5-2.13). Its
        communicator forms at the first op, blocking until the peer's."""
        import torch.distributed as dist

        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, opts)

    def synchronize(self) -> None:
        host_syncs.note(self._device)
        torch.cuda.synchronize(self._device)

    def timing_event(self):
        return torch.cuda.Event(enable_timing=True)

    graph_mode_default = "eager"
    """Not measured: no GPU has run afd's CUDA graphs yet (tests/test_graph_cuda.py is written, skipped here).
    vLLM and SGLang capture decode CUDA graphs by default, for the launch overhead of small decode kernels, so
    `compile` is expected to win; it becomes the default once a GPU run of `make test-device` holds it."""

    # torch.cuda.graph's __enter__ runs torch.cuda.synchronize() and torch.cuda.empty_cache() (source: pytorch
    # torch/cuda/graphs.py, graph.__enter__, torch 2.13): a capture mid-step would drain the GPU and flush the
    # caching allocator inside a live decode step.
    capture_at_warmup = True

    def compile(self, fn, cache_dir: str | None = None):
        # One CUDA graph of fn's kernels, captured on the first call. There is nothing to cache across
        # restarts (a graph holds this process's device addresses): cache_dir is not used. The data plane's
        # NCCL sends and receives stay outside: afd.engine.graph captures the compute between two exchanges,
        # and the exchange's sizes, peers and blocking-wait timeouts are the host's business every step.
        if "_graph_pool" not in self.__dict__:
            self._graph_pool = torch.cuda.graph_pool_handle()  # shared: graphs replay one at a time
        return _CudaGraph(fn, self._device, self._graph_pool)

    def memory_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self._device)

    # prefetch stays the base no-op: a GEMM on a GPU already streams its weights from HBM at full
    # bandwidth, and the real L2 tool (a cudaAccessPolicyWindow persisting region) is not reachable
    # from torch without the CUDA runtime API. Reasoned, not measured: see docs/benchmarks/suite.md.

    @staticmethod
    def grouped_mm_fast_path(
        torch_version: str, capability: tuple[int, int] | None, hip: bool, dtype: torch.dtype, k: int, n: int
    ) -> bool:
        """Whether torch._grouped_mm runs its fused kernel (offsets stay on the device) for x [T, k] @ w [G, k, n]
        of `dtype`, contiguous, on a GPU of compute `capability` under `torch_version`. Elsewhere it raises
        (torch 2.8) or takes a fallback that copies the offsets to the host and loops over groups (2.9 on),
        which is what grouped_matmul_by_slices does without its alignment and dtype rules."""
        # source: pytorch aten/src/ATen/native/cuda/Blas.cpp (_grouped_mm_cuda, torch 2.8: a device check
        #   _scaled_mm_allowed_device(sm90_only=true), i.e. major == 9, else "torch._grouped_mm is only supported
        #   on CUDA devices with compute capability = 9.0"; bf16 only), quoted in
        #   https://github.com/huggingface/transformers/issues/47999; fallback added by
        #   https://github.com/pytorch/pytorch/pull/161407 and /162059 (torch 2.9).
        # source: pytorch aten/src/ATen/native/cuda/GroupedBlas.cpp (_grouped_mm_cuda: fast path iff
        #   sm90_only or sm100_only device, i.e. major 9 or 10, and bf16 inputs and output) and
        #   aten/src/ATen/native/GroupedMMUtils.h (check_valid_strides_and_return_transposed: the major stride
        #   a multiple of 16 bytes), https://github.com/pytorch/pytorch, main at 00d4eaf9 (GroupedBlas.cpp) and
        #   2295ac79 (GroupedMMUtils.h), 2026.
        # Pre-releases count as the previous release (TorchVersion("2.9.0a0") < (2, 9)): conservative.
        from torch.torch_version import TorchVersion

        version = TorchVersion(torch_version)
        if hip or capability is None or version < (2, 8) or dtype != torch.bfloat16:  # type: ignore[operator]
            return False  # ROCm: 2.8 refuses, later only CK builds on some gfx take a fused path
        if capability[0] not in ((9,) if version < (2, 9) else (9, 10)):  # type: ignore[operator]
            return False
        return k > 0 and n > 0 and (k * dtype.itemsize) % 16 == 0 and (n * dtype.itemsize) % 16 == 0

    def grouped_matmul_in_graph(self, w: torch.Tensor) -> bool:
        # only torch._grouped_mm's fused path keeps the offsets on the device; the fallback reads them
        return hasattr(torch, "_grouped_mm") and self.grouped_mm_fast_path(
            torch.__version__,
            torch.cuda.get_device_capability(w.device),
            bool(torch.version.hip),
            w.dtype,
            *w.shape[1:],
        )

    def grouped_matmul(self, x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        fast = (
            hasattr(torch, "_grouped_mm")
            and x.dtype == w.dtype
            and x.is_contiguous()
            and w.is_contiguous()
            and x.data_ptr() % 16 == 0
            and w.data_ptr() % 16 == 0  # GroupedMMUtils.h: 16-byte aligned data
            and self.grouped_mm_fast_path(
                torch.__version__,
                torch.cuda.get_device_capability(x.device),
                bool(torch.version.hip),
                x.dtype,
                x.shape[1],
                w.shape[-1],
            )
        )
        if fast:
            # end row of each group, int32; the last ends at x's end (rows past the groups, which the caller
            # drops, join it) so that no output row is left unwritten
            offs = sizes_covering(group_sizes, x.shape[0]).cumsum(0, dtype=torch.int32)
            return torch._grouped_mm(x, w, offs=offs)
        return grouped_matmul_by_slices(x, w, group_sizes)

    def quant_matmul(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, spec) -> torch.Tensor:
        # block-scaled FP8 / int8 GEMMs where their gates allow, else dequantized: afd/backend/cuda_quant.py
        from afd.backend import cuda_quant

        return cuda_quant.quant_matmul(x, q, scale, spec, self._quant_env())

    # quant_grouped_matmul stays the base per-group loop (sizes read on the host): no fused grouped kernel takes
    # afd's scales (cuda_quant's docstring); grouped_matmul_in_graph already says False for int8 / fp8 weights.

    def check_quantization(self, spec) -> None:
        from afd.backend import cuda_quant

        cuda_quant.check_quantization(spec, self._quant_env())

    def _quant_env(self):
        # read once: a capability query per GEMM would cost microseconds on every linear of every step
        if "_quant_env_cached" not in self.__dict__:
            from afd.backend.cuda_quant import CudaQuantEnv

            self._quant_env_cached = CudaQuantEnv.of(self._device)
        return self._quant_env_cached


class _CudaGraph:
    """fn as one CUDA graph: the first call warms up on a side stream (lazy cuBLAS and allocator set-up stay
    out of the graph), captures, and replays; later calls copy their tensor inputs into the captured ones
    (skipped when they are the same memory: the KV cache, the weights) and replay. Outputs are cloned: the
    next replay of this graph rewrites its own, while a micro-batch's m may still be in flight to the FFN."""

    def __init__(self, fn, device: torch.device, pool):
        self.fn, self.device, self.pool = fn, device, pool
        self.graph: torch.cuda.CUDAGraph | None = None

    def __call__(self, *args):
        from torch.utils._pytree import tree_flatten, tree_map

        flat, spec = tree_flatten(args)
        if self.graph is None:
            self._capture(args, flat, spec)
        else:
            if spec != self.spec or len(flat) != len(self.inputs):
                raise ValueError("a CUDA graph is replayed with inputs of another structure")
            for new, old in zip(flat, self.inputs):
                if isinstance(old, torch.Tensor):
                    if new.data_ptr() != old.data_ptr():
                        old.copy_(new)  # shapes match: afd.engine.graph keys graphs by every shape
                elif new != old:
                    raise ValueError(f"a CUDA graph is replayed with {new!r} where it was captured with {old!r}")
        assert self.graph is not None  # captured above
        self.graph.replay()
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self.outputs)

    def _capture(self, args, flat, spec) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.fn(*args)  # warm-up (its KV writes are the ones the replay below makes again)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (the metrics scrape) may use CUDA meanwhile; this one may not
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.outputs = self.fn(*args)
        self.graph, self.inputs, self.spec = graph, flat, spec  # the inputs captured: held, so never freed
