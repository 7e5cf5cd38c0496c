"""The Ascend backend: HCCL data plane (its own streams, ordered by ProcessGroupHCCL), torch_npu fused
MoE ops, torchair graphs.

torch_npu and torchair are imported here only, when the backend is constructed: importing afd on a
machine without them never fails.
"""

from __future__ import annotations

import torch

from afd.backend.base import Backend, DeviceUnavailable, grouped_matmul_by_slices


def _import_torch_npu():
    try:
        import torch_npu  # noqa: F401  (registers the "npu" device with torch)
    except ImportError as e:
        raise DeviceUnavailable(f"device npu: torch_npu is not importable ({e})") from None
    return torch_npu


# source: torch_npu.npu_grouped_matmul, https://github.com/Ascend/op-plugin/blob/7.1.0/docs/context/
#   torch_npu-npu_grouped_matmul.md, op-plugin 7.1.0 (torch_npu 2.6.0); the same limits in 26.0.0.
GMM_MAX_GROUPS = 1024
"""Groups one call takes with a single x and a single 3-D weight."""
GMM_INNER_LIMIT = 65536
"""Atlas A2/A3: x's last dim (K) and the weight's (N) must be below it."""


class NpuBackend(Backend):
    name = "npu"
    dist_backend = "hccl"
    # On by default: the seed's Atlas A3 measurements (LongCat-Flash AFD) show the FFN-side GMM weight
    # prefetch paying off; this suite cannot run there (docs/benchmarks.md).
    prefetch_by_default = True

    def __init__(self, index: int = 0):
        self._torch_npu = _import_torch_npu()
        self._device = torch.device("npu", index)
        self.bind_thread()

    @property
    def device(self) -> torch.device:
        return self._device

    # HCCL's wait() honours its timeout only in blocking mode, which also aborts the communicators on a
    # timeout and turns the watchdog off. source: Ascend/pytorch torch_npu/csrc/distributed/
    # ProcessGroupHCCL.hpp (TORCH_HCCL_BLOCKING_WAIT = {"TORCH_HCCL_BLOCKING_WAIT", "HCCL_BLOCKING_WAIT"})
    # and ProcessGroupHCCL.cpp WorkHCCL::synchronizeInternal, master @9e73e70 (2026-08).
    peer_failure_breaks_group = True

    def comm_env(self) -> dict[str, str]:
        return {"TORCH_HCCL_BLOCKING_WAIT": "1", "HCCL_BLOCKING_WAIT": "1"}  # older torch_npu reads the second

    def synchronize(self) -> None:
        torch.npu.synchronize(self._device)

    def memory_info(self) -> tuple[int, int]:
        return torch.npu.mem_get_info(self._device)

    def grouped_matmul(self, x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        groups, k_dim, n_dim = w.shape
        if groups == 1:  # group_list_type=1 refuses a group list of length 1: an FFN node with one expert
            return torch.mm(x, w[0])
        if groups > GMM_MAX_GROUPS or max(k_dim, n_dim) >= GMM_INNER_LIMIT or x.shape[0] == 0:
            # Outside the fused op's documented limits (no model afd serves comes near them): correct, but
            # it reads the group sizes on the host.
            return grouped_matmul_by_slices(x, w, group_sizes)
        # split_item=2: one output tensor; group_type=0: groups along M; group_list_type=1: counts, int64,
        # kept on the device (no host read, nothing for a torchair graph to break on).
        (y,) = self._torch_npu.npu_grouped_matmul(
            [x], [w], group_list=group_sizes.to(torch.int64), split_item=2, group_type=0, group_list_type=1)
        return y

    def prefetch(self, weight: torch.Tensor, max_bytes: int, dependency: torch.Tensor | None = None) -> int:
        # npu_prefetch(input, dependency, max_size): an L2 hint that starts after `dependency`'s producer.
        # Graph mode (torchair) refuses dependency=None, so one is always passed: without a caller's choice,
        # the weight itself. The doc makes `dependency` only the node the prefetch starts after, read for
        # ordering, not data ("不做数据处理，与数据类型和数据格式无关"); the weight is already the prefetch's
        # input, so ordering after it adds no edge beyond that one: the hint may start as soon as the weight
        # exists, which is what an eager call with None does. max_size must be > 0, hence the n > 0 guard;
        # a max_size past the tensor's end is clamped by the op, but n never exceeds it anyway.
        # source: torch_npu.npu_prefetch, https://github.com/Ascend/op-plugin/blob/7.1.0/docs/context/
        #   torch_npu-npu_prefetch.md, op-plugin 7.1.0; torchair npu_prefetch converter,
        #   https://github.com/Ascend/torchair/blob/7.1.0/python/torchair/_ge_concrete_graph/ge_converter/
        #   custom/npu_prefetch.py, torchair 7.1.0
        n = min(max_bytes, weight.numel() * weight.element_size())
        if n > 0:
            self._torch_npu.npu_prefetch(weight, weight if dependency is None else dependency, n)
        return n

    def compile(self, fn):
        import torchair  # after torch_npu, as torchair requires

        config = torchair.CompilerConfig()
        return torch.compile(fn, backend=torchair.get_npu_backend(compiler_config=config), dynamic=False)
