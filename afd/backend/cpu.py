"""The CPU backend: the reference every test runs on (gloo data plane)."""

from __future__ import annotations

import logging
import os
from collections import Counter
from datetime import timedelta

import torch
from torch import nn

from afd.backend.base import Backend, PrefetchSpec, grouped_matmul_by_slices, refuse_host_syncs
from afd.backend.cpu_packed import PackedGroups
from afd.backend.cpu_packed import grouped as packed_grouped

log = logging.getLogger("afd.backend")

ROW_MAJOR_ENV = "AFD_CPU_ROW_MAJOR_WEIGHTS"
"""Set to 1: column_major_linears leaves weights as loaded (what afd bench-graph --vs-hf compares against)."""


def column_major_linears(module: nn.Module) -> nn.Module:
    """Every nn.Linear weight [out, in] of `module` laid out column-major (its transpose [in, out] contiguous),
    in place: F.linear then hands MKL's sgemm a right-hand side it reads without transposing, which runs
    1.3-2.5x faster on one thread at decode sizes (4-64 rows; neutral at 1: docs/benchmarks/graph-mode.md,
    afd bench-graph --vs-hf). Values, shapes and Parameters are unchanged; a weight another module shares (a
    tied lm_head) stays as it is, since the embedding gathers its rows. Besides nn.Linear, any module whose
    class sets `linear_weight = True` (the TP layers of afd.model.tp.layers) is laid out too."""
    if os.environ.get(ROW_MAJOR_ENV) == "1":
        return module
    uses = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    for mod in module.modules():
        linear = isinstance(mod, nn.Linear) or getattr(type(mod), "linear_weight", False)
        w = getattr(mod, "weight", None) if linear else None
        if w is not None and w.dim() == 2 and uses[id(w)] == 1 and w.is_contiguous() and w.shape[0] > 1:
            w.data = w.data.t().contiguous().t()
    return module


class CpuBackend(Backend):
    name = "cpu"
    dist_backend = "gloo"

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def pair_group(self, store, rank: int, timeout: timedelta, group_id: str):
        """ProcessGroupGloo(store, rank, 2, timeout) (torch/csrc/distributed/c10d/init.cpp; its devices follow
        GLOO_SOCKET_IFNAME, set by afd.dataplane.rendezvous.bind_gloo), with the connections that carry it
        (afd.backend.gloo_pairs), which abort_group shuts."""
        from afd.backend.gloo_pairs import form

        return form(store, rank, timeout)

    def abort_group(self, pg) -> None:
        """gloo has no abort that ends a blocked wait (afd.backend.gloo_pairs): the group's connections are shut
        down instead, which fails its pending operations on both ends at once."""
        shut = pg.shut_connections()
        log.info("gloo pair group aborted: %d connection(s) shut down", shut)

    def memory_info(self) -> tuple[int, int]:
        """(available, total) RAM of this process: afd.backend.cpu_memory."""
        from afd.backend.cpu_memory import memory_info

        return memory_info()

    def prefetch(
        self, weight: torch.Tensor, max_bytes: int, dependency: torch.Tensor | None = None, offset: int = 0
    ) -> int:
        # Reads one value per 64-byte line of max_bytes from byte `offset`: the lines land in the caches
        # before the GEMM needs them (now: a CPU has no dependency to wait for). Costs memory bandwidth on the
        # serving thread; the suite decides whether it pays (off by default). A packed weight's blocks are not at
        # a plain weight's offsets: nothing to hint.
        if isinstance(weight, PackedGroups):
            return 0
        w = weight.detach()
        flat = (w if w.is_contiguous() or w.dim() != 2 else w.t()).reshape(-1)  # a view: column-major too
        size = flat.element_size()
        first = offset // size
        n = min(flat.numel() - first, max_bytes // size)
        if n <= 0:
            return 0
        flat[first : first + n : max(1, 64 // size)].sum()
        return n * size

    def prefetch_spec(self) -> PrefetchSpec:
        from afd.backend.cpu_spec import cpu_prefetch_spec  # measured once, when first asked

        return cpu_prefetch_spec()

    group_sizes_on_host = True  # grouped_matmul_by_slices reads them (a CPU tensor: no sync)

    def grouped_matmul(self, x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        # One GEMM per non-empty group over a contiguous row slice: on CPU this measures as fast as
        # torch._grouped_mm and has no alignment constraints. In bf16 or fp16, by the kernel timed fastest.
        if isinstance(w, PackedGroups):
            return packed_grouped(x, w, group_sizes)
        if x.dtype in (torch.bfloat16, torch.float16):
            from afd.backend import cpu_kernels

            return cpu_kernels.grouped(x, w, group_sizes)
        return grouped_matmul_by_slices(x, w, group_sizes)

    def quant_matmul(self, x, q, scale, spec):
        from afd.backend import cpu_kernels
        from afd.backend.cpu_quant import is_w8a8

        return cpu_kernels.w8a8_linear(x, q, scale) if is_w8a8(spec) else super().quant_matmul(x, q, scale, spec)

    def quant_grouped_matmul(self, x, q, scale, group_sizes, spec):
        from afd.backend import cpu_kernels
        from afd.backend.cpu_quant import is_w8a8

        if is_w8a8(spec):
            return cpu_kernels.w8a8_grouped(x, q, scale, group_sizes)
        return super().quant_grouped_matmul(x, q, scale, group_sizes, spec)

    def check_quantization(self, spec) -> None:
        from afd.backend.cpu_quant import cpu_quant_kernel, log

        log.info("quantization %s; its GEMMs on CPU: %s", spec.describe(), cpu_quant_kernel(spec))

    graph_mode_default = "eager"
    """Measured with `afd bench-graph` (balanced scenario, one thread per process, on the shared 2-core machine
    that built this; docs/benchmarks/graph-mode.md has the full run): compiled / eager decode tokens/s was
    0.91-1.15x at batch 1-64, colocated and 1A1F (1.13-1.27x at best and 0.85x at worst in earlier short
    runs), within the spread of the rounds, while a bucket's graphs take 12-31 s to compile with a cold cache
    (2-6.5 s warm) for every block-table width they meet. The step is GEMM time, which inductor hands to
    the same MKL calls. No consistent gain: eager by default."""

    graph_compiler = "inductor"
    """The torch.compile backend of compile(); tests swap in aot_eager (the same trace, no C++ compile)."""

    def compile(self, fn, cache_dir: str | None = None):
        # inductor, static shapes, one graph: a graph break or a host sync fails the compile, and afd.engine.graph
        # runs that graph eager. Its compiled code lands in cache_dir (TORCHINDUCTOR_CACHE_DIR's FX graph and
        # AOTAutograd caches), where the next process finds it.
        return _Inductor(
            torch.compile(fn, backend=refuse_host_syncs(self.graph_compiler), dynamic=False, fullgraph=True), cache_dir
        )


class _Inductor:
    """A torch.compile'd function whose first call (the compile) reads and writes `cache_dir`."""

    def __init__(self, fn, cache_dir: str | None):
        self.fn, self.cache_dir = fn, cache_dir

    def __call__(self, *args):
        if self.cache_dir is None:
            return self.fn(*args)
        path, self.cache_dir = os.path.abspath(self.cache_dir), None  # compiled by this call: later ones run it
        os.makedirs(path, exist_ok=True)
        try:
            from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
        except ImportError:  # older torch: the directory for the whole process
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
            return self.fn(*args)
        with temporary_cache_dir(path):  # sets TORCHINDUCTOR_CACHE_DIR, clears inductor's cached paths
            return self.fn(*args)
