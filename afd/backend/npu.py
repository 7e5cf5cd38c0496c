"""The Ascend backend: HCCL data plane on a side stream, torch_npu fused MoE ops, torchair graphs.

torch_npu and torchair are imported here only, when the backend is constructed: importing afd on a
machine without them never fails.
"""

from __future__ import annotations

import torch

from afd.backend.base import Backend, DeviceUnavailable


def _import_torch_npu():
    try:
        import torch_npu  # noqa: F401  (registers the "npu" device with torch)
    except ImportError as e:
        raise DeviceUnavailable(f"device npu: torch_npu is not importable ({e})") from None
    return torch_npu


class NpuBackend(Backend):
    name = "npu"
    dist_backend = "hccl"
    # On by default: the seed's Atlas A3 measurements (LongCat-Flash AFD) show the FFN-side GMM weight
    # prefetch paying off; this suite cannot run there (docs/benchmarks.md).
    prefetch_by_default = True

    def __init__(self, index: int = 0):
        self._torch_npu = _import_torch_npu()
        self._device = torch.device("npu", index)
        torch.npu.set_device(self._device)
        self._comm = torch.npu.Stream(device=self._device)

    @property
    def device(self) -> torch.device:
        return self._device

    def synchronize(self) -> None:
        torch.npu.synchronize(self._device)

    def comm_stream(self):
        return self._comm

    def stream_scope(self, stream):
        return torch.npu.stream(stream)

    def record_event(self):
        ev = torch.npu.Event()
        ev.record()
        return ev

    def wait_event(self, event, stream=None) -> None:
        (stream or torch.npu.current_stream()).wait_event(event)

    def memory_info(self) -> tuple[int, int]:
        return torch.npu.mem_get_info(self._device)

    def grouped_matmul(self, x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        group_list = group_sizes.to(torch.int64)
        # split_item=2: one output tensor; group_type=0: groups along M; group_list_type=1: counts.
        (y,) = self._torch_npu.npu_grouped_matmul(
            [x], [w], group_list=group_list, split_item=2, group_type=0, group_list_type=1)
        return y

    def prefetch(self, weight: torch.Tensor, max_bytes: int, dependency: torch.Tensor | None = None) -> int:
        # npu_prefetch(input, dependency, max_size): an L2 hint ordered after `dependency`'s producer
        # (which graph mode requires); eager mode may pass None.
        n = min(max_bytes, weight.numel() * weight.element_size())
        if n > 0:
            self._torch_npu.npu_prefetch(weight, dependency, n)
        return n

    def compile(self, fn):
        import torchair  # after torch_npu, as torchair requires

        config = torchair.CompilerConfig()
        return torch.compile(fn, backend=torchair.get_npu_backend(compiler_config=config), dynamic=False)
