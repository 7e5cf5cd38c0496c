"""The fake HCCL group's collectives (attention TP): gloo computes on the payloads, the fake checks devices and
streams.

source: Ascend/pytorch (torch_npu) master @9e73e70, 2026-08-21, torch_npu/csrc/distributed/ProcessGroupHCCL.cpp,
  `collective` (allreduce, _allgather_base / all_gather_single, _reduce_scatter_base / reduce_scatter_single,
  alltoall_base): one HCCL stream per device for a group's collectives (getKeyFromDevices), made to wait for the
  current stream (syncStreams), inputs and outputs recordStream'd on it; a work's wait() as for point-to-point.
  (attention TP, afd/model/tp/comm.py)
"""

from __future__ import annotations

from . import device as npu
from .hccl_work import _Work


class _Collectives:
    """FakeHcclGroup's collectives; the group supplies _check, _stream, _run_on and _gloo."""

    def _collective(self, kind: str, reads: list, writes: list, inner_op) -> _Work:
        t = writes[0]
        if any(x.device != t.device for x in reads + writes):
            raise RuntimeError(
                f"fake hccl {kind}: tensors on {sorted({str(x.device) for x in reads + writes})}; "
                "a collective's tensors must be on one device"
            )
        stream = self._stream(t, -1)  # one stream per device for the group's collectives
        with npu._lock:
            stream._merge(npu.current_stream(t.device.index).clock)
            seq = npu.access(stream, reads, writes, f"hccl {kind}")
        return self._run_on((t.device.index, -1), _Work(self, inner_op(), stream, seq, kind, -1))

    def allreduce(self, tensors, opts=None):
        t = self._check(tensors, "allreduce")
        return self._collective("allreduce", [t], [t], lambda: self._gloo.allreduce([t._payload]))

    def all_gather_single(self, output, input, opts=None):
        o, i = self._check([output], "all_gather"), self._check([input], "all_gather")
        return self._collective("all_gather", [i], [o], lambda: self._gloo._allgather_base(o._payload, i._payload))

    _allgather_base = all_gather_single

    def reduce_scatter_single(self, output, input, opts=None):
        o, i = self._check([output], "reduce_scatter"), self._check([input], "reduce_scatter")
        return self._collective(
            "reduce_scatter", [i], [o], lambda: self._gloo._reduce_scatter_base(o._payload, i._payload)
        )

    _reduce_scatter_base = reduce_scatter_single

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        o, i = self._check([output], "all_to_all"), self._check([input], "all_to_all")
        return self._collective(
            "all_to_all",
            [i],
            [o],
            lambda: self._gloo.alltoall_base(o._payload, i._payload, output_split_sizes, input_split_sizes),
        )

    alltoall_base = all_to_all_single
