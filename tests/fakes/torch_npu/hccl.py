"""A fake `hccl` process group: gloo moves the bytes, and the behaviour of torch_npu's ProcessGroupHCCL
that afd depends on is reproduced and checked.

source: Ascend/pytorch (torch_npu) master @9e73e70, 2026-08-21:
- torch_npu/_init/registry/distributed.py: `register_backend("hccl", ..., devices=["npu"])`: the group
  takes npu tensors only; a CPU tensor fails in c10d's ProcessGroup::getBackend with "No backend type
  associated with device type cpu" (pytorch torch/csrc/distributed/c10d/ProcessGroup.hpp).
- torch_npu/csrc/distributed/ProcessGroupHCCL.cpp, `pointToPoint`: the communicator and its stream are
  keyed by the rank pair (getKeySendRecv) or by the device (getKeyFromDevices): sends and receives
  between two ranks share one stream and run in issue order. `syncStreams` makes that stream wait for
  the issuing thread's current stream of the tensor's device; the tensor is recordStream'd on it.
- the same file, `pointToPoint` and `getHCCLComm`: a communicator is created at its first op
  (HcclCommInitRootInfo, which blocks until every rank of it has called it): per pair (getKeySendRecv) when
  P2P_HCCL_BUFFSIZE is not 0 (torch_npu's default is 20, OptionsManager::GetP2PBufferSize) and the CANN has
  HcclCommInitRootInfoConfig, else one for the whole group, shared by every pair, on one stream
  (getKeyFromDevices). The fake forms its point-to-point communicators so (a store barrier, HangError after
  HANG_S), per pair unless P2P_HCCL_BUFFSIZE=0; collectives' communicators are not modelled.
- getHcclDataType: the dtypes HCCL moves.
- `getHcclCommName` (bound as `get_hccl_comm_name(rankid, init_comm=True)` in torch_npu/csrc/distributed/
  Init.cpp), reached as `group._get_backend(torch.device("npu"))`, which is how the fused communication ops'
  documents obtain `hcom` (op-plugin docs, torch_npu-npu_mm_reduce_scatter_base.md, 7.1.0 to 26.0.0): rankid
  must be >= 0 and serves only a warning (not modelled) when rankid % device_count is not the current device;
  the name is the current device's communicator's, created on the way unless init_comm=False (then "").

The waits, a dead peer's transfers and blocking-wait timeouts: hccl_work.py; the collectives:
hccl_collectives.py.

Teardown and abort (afd/dataplane/transport.py aborts instead of destroying when work may be queued):
- the same file, `ProcessGroupHCCL::shutdown` (what c10d's destroy_process_group calls on every group):
  it synchronizes every HCCL stream of the group ("Temporarily use stream synchronization as a substitute
  for the HCCL finalize API") before destroying the communicators, so a send or receive that never
  completes (its peer is dead) blocks it, on a real HCCL up to HCCL_EXEC_TIMEOUT. The fake's shutdown()
  raises HangError when a send/receive issued on the group has not completed within SHUTDOWN_WAIT_S (or
  failed: a transfer whose peer died never completes on an HCCL stream), and records it
  (`STATS["shutdown_hangs"]`): a node that would hang never goes unnoticed.
- `ProcessGroupHCCL::abortAndClearHcclComm(c10::optional<std::string> abortReason)`, bound as
  `abort_hccl_comm` in Init.cpp (one positional argument, a string or None) and called by torch_npu's own
  `reinit_process_group` as `group._get_backend(torch.device("npu")).abort_hccl_comm("reinit")`
  (torch_npu/distributed/distributed_c10d.py): every communicator of the group destroyed
  (abortCommsFromMap -> HCCLComm::destroyHcclComm -> hcclCommDestroy), no stream synchronized, the
  communicator maps cleared. The fake fails the group's pending works with an error at once (also a wait
  another thread is blocked in: a thread per stream waits for the transfers, in issue order, and a wait()
  waits for that thread or the abort) and leaves every other group working; a group is
  one pair in afd, so that is the per-pair abort. What CANN does with a task in flight on a destroyed
  communicator is not in torch_npu's source: the fake assumes it stays on the stream, so a shutdown()
  after an abort still hangs on it (afd never calls one). A later op on the group would create a new
  communicator and block in HcclCommInitRootInfo until the peer does the same: the fake raises HangError.
- ProcessGroupHCCL declares `bool abort(c10::optional<std::string>)`, which does not override c10d's
  `void Backend::abort()` (a no-op: pytorch torch/csrc/distributed/c10d/Backend.hpp): `pg.abort()`, and so
  `torch.distributed.distributed_c10d._abort_process_group`, aborts nothing on HCCL; the fake's abort() is
  that no-op. _abort_process_group forgets the group without calling shutdown(), which is what afd uses it
  for. (PyTorch's ProcessGroupNCCL.cpp for comparison: "abort() will signal communicators to terminate all
  NCCL kernels immediately; shutdown() will wait for all NCCL kernels to finish before destroying
  communicators".)
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from . import device as npu
from . import ops
from .hccl_collectives import _Collectives
from .hccl_work import HANG_S, HangError, _runner, _Work

HCCL_DTYPES = {
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bool,
    torch.bfloat16,
}
SHUTDOWN_WAIT_S = 1.0
"""How long shutdown() lets issued transfers finish (a stream synchronization) before it says it would hang."""
STATS = {"sends": 0, "recvs": 0, "send_behind_recv": 0, "aborts": 0, "shutdowns": 0, "shutdown_hangs": []}
_COMM_IDS = itertools.count()


class _Hccl(_Collectives):
    """What ProcessGroupHCCL does, on either base below: `_gloo` moves the bytes; the streams, the
    communicators' forming, the works' waits, abort and shutdown are HCCL's."""

    def _setup(self, store, gloo) -> None:
        self._gloo = gloo
        self._streams: dict[tuple[int, int], npu.Stream] = {}
        self._pending: dict[tuple[int, int], list[_Work]] = {}
        self._mu = threading.Lock()
        self._comm_name = ""
        self._aborted: str | None = None
        """Why abort_hccl_comm destroyed this group's communicators (None: it did not)."""
        self._issued: list[_Work] = []
        """The send/receives issued on the group and not yet completed, for shutdown()'s stream synchronization."""
        self._runners: dict[tuple[int, int], queue.SimpleQueue] = {}
        """Per stream: the queue of its runner thread, which waits for each transfer in issue order."""
        self._per_pair = int(os.environ.get("P2P_HCCL_BUFFSIZE", "20")) != 0
        """Point-to-point on a communicator per pair (torch_npu's default), else on the group's one."""
        self._formed: set[str] = set()
        self._form_store = dist.PrefixStore("fake-hccl-comm", store)

    def getBackendName(self) -> str:
        return "hccl"

    def get_hccl_comm_name(self, rankid: int, init_comm: bool = True) -> str:
        """The name the fused communication ops take as `hcom`; the fake op reduces over this group's gloo."""
        if rankid < 0:
            raise RuntimeError(f"Invalid rank {rankid}")
        if not self._comm_name:
            if not init_comm:
                return ""
            self._comm_name = f"fake_hccl_comm_{next(_COMM_IDS)}"
            ops.register_hcom(self._comm_name, self._gloo)
        return self._comm_name

    def abort_hccl_comm(self, abortReason: str | None, /) -> None:
        """ProcessGroupHCCL::abortAndClearHcclComm: the group's communicators destroyed without waiting for
        their streams; here, the group's pending works fail at once."""
        with self._mu:
            if self._aborted is None:
                self._aborted = abortReason or "aborted"
                STATS["aborts"] += 1
            for w in self._issued:
                w._wake.set()
            for tasks in self._runners.values():  # each runner ends after the transfer it may be waiting for
                tasks.put(None)
            self._runners.clear()

    def abort(self) -> None:
        """c10d's ProcessGroup.abort(): on HCCL it reaches Backend::abort, a no-op (see the module docstring)."""

    def shutdown(self) -> None:
        """ProcessGroupHCCL::shutdown: synchronizes the group's HCCL streams, then destroys the communicators."""
        STATS["shutdowns"] += 1
        with self._mu:
            issued = list(self._issued)
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        for w in issued:
            w._ran.wait(max(0.0, deadline - time.monotonic()))
        stuck = [w for w in issued if w._stuck()]
        with self._mu:
            for tasks in self._runners.values():
                tasks.put(None)
            self._runners.clear()
        if stuck:
            what = ", ".join(f"{w.kind} with rank {self._global(w.peer)}" for w in stuck[:4])
            what += ", ..." if len(stuck) > 4 else ""
            message = (
                f"fake hccl: shutdown() of a group with {len(stuck)} send/recv that never completed ({what}); "
                "ProcessGroupHCCL::shutdown synchronizes the group's HCCL streams first, so a real HCCL would "
                "hang here, up to HCCL_EXEC_TIMEOUT"
                + (f" (the group's communicators were aborted before: {self._aborted})" if self._aborted else "")
            )
            STATS["shutdown_hangs"].append(message)
            raise HangError(message)

    def _global(self, group_rank: int) -> int:
        """The global rank of a peer (c10d hands a group its group ranks)."""
        try:
            return dist.get_global_rank(self, group_rank)
        except (RuntimeError, ValueError):
            return group_rank

    def _check(self, tensors: list[torch.Tensor], what: str) -> npu.NpuTensor:
        if len(tensors) != 1:
            raise RuntimeError(f"fake hccl {what}: one tensor per call, got {len(tensors)}")
        (t,) = tensors
        if t.device.type != "npu":
            raise RuntimeError(f"No backend type associated with device type {t.device.type}")
        if t.dtype not in HCCL_DTYPES:
            raise RuntimeError(f"fake hccl {what}: unsupported dtype {t.dtype} for HCCL")
        if not t.is_contiguous():
            raise RuntimeError(f"fake hccl {what}: tensors must be contiguous")
        return t

    def _stream(self, t: npu.NpuTensor, peer: int) -> npu.Stream:
        key = (t.device.index, peer)
        with self._mu:
            if key not in self._streams:
                lo, hi = sorted((self.rank(), peer))
                what = f"{lo}:{hi}" if peer >= 0 else "collectives" if peer == -1 else "point-to-point"
                self._streams[key] = npu.new_stream(t.device.index, f"hccl stream {what} of group {id(self):x}")
            return self._streams[key]

    def _form(self, key: str, ranks: int, what: str) -> None:
        """getHCCLComm: the first op on a communicator creates it (HcclCommInitRootInfo), which blocks until
        every rank of it does the same."""
        with self._mu:
            if key in self._formed:
                return
        joined, deadline = self._form_store.add(key, 1), time.monotonic() + HANG_S
        while joined < ranks:
            if time.monotonic() > deadline:
                raise HangError(
                    f"fake hccl: {what} is the first op on {key} of this group, whose communicator forms only "
                    f"once all its {ranks} ranks issue their first op on it ({joined} did): a real HCCL blocks "
                    "here in HcclCommInitRootInfo (up to HCCL_CONNECT_TIMEOUT)"
                )
            time.sleep(0.005)
            joined = self._form_store.add(key, 0)
        with self._mu:
            self._formed.add(key)

    def _issue(self, kind: str, t: npu.NpuTensor, peer: int, inner_op) -> _Work:
        if self._aborted is not None:
            raise HangError(
                f"fake hccl: {kind} with rank {peer} on a group whose communicators were aborted "
                f"({self._aborted}); a real ProcessGroupHCCL would create a new communicator here and block in "
                "HcclCommInitRootInfo until the peer does the same"
            )
        if self._per_pair:  # pointToPoint: the pair's own communicator and stream (getKeySendRecv)
            lo, hi = sorted((self.rank(), peer))
            self._form(f"the pair communicator {lo}:{hi}", 1 if lo == hi else 2, f"{kind} with rank {peer}")
            key = (t.device.index, peer)
        else:  # P2P_HCCL_BUFFSIZE=0: the group's communicator and one stream (getKeyFromDevices)
            self._form("the group communicator", self.size(), f"{kind} with rank {peer}")
            key = (t.device.index, -2)
        stream = self._stream(t, key[1])
        with npu._lock:
            # syncStreams: the communication stream waits for the issuing thread's current stream
            stream._merge(npu.current_stream(t.device.index).clock)
            with self._mu:  # a receive nobody has waited for yet may still be running on this stream
                if kind == "send" and any(w.kind == "recv" for w in self._pending.get(key, [])):
                    STATS["send_behind_recv"] += 1
            seq = npu.access(
                stream, [t] if kind == "send" else [], [t] if kind == "recv" else [], f"hccl {kind} with rank {peer}"
            )
        try:
            inner = inner_op()
        except RuntimeError:  # gloo already knows the peer's sockets closed (kill -9); an HCCL stream does not
            inner = None
        work = self._run_on(key, _Work(self, inner, stream, seq, kind, peer))
        with self._mu:
            self._pending.setdefault(key, []).append(work)
        STATS[kind + "s"] += 1
        return work

    def _run_on(self, key: tuple[int, int], work: _Work) -> _Work:
        with self._mu:
            tasks = self._runners.get(key)
            if tasks is None:
                tasks = self._runners[key] = queue.SimpleQueue()
                threading.Thread(target=_runner, args=(tasks,), name=f"fake-hccl-stream-{key}", daemon=True).start()
            self._issued = [w for w in self._issued if w._stuck()] + [work]  # only what a shutdown could block on
        tasks.put(work)
        return work

    def _finished(self, work: _Work) -> None:
        with self._mu:
            for lst in self._pending.values():
                if work in lst:
                    lst.remove(work)

    def send(self, tensors, dst: int, tag: int = 0):
        t = self._check(tensors, "send")
        return self._issue("send", t, dst, lambda: self._gloo.send([t._payload], dst, tag))

    def recv(self, tensors, src: int, tag: int = 0):
        t = self._check(tensors, "recv")
        return self._issue("recv", t, src, lambda: self._gloo.recv([t._payload], src, tag))

    def barrier(self, opts=None):
        return self._gloo.barrier()


class FakeHcclGroup(_Hccl, dist.ProcessGroup):
    """A registered "hccl" group (init_process_group, new_group: attention TP). torch_npu registers
    ProcessGroupHCCL as such a group's backend for "npu", reached as `group._get_backend(npu)`; this fake is
    group and backend in one (a Python ProcessGroup, which c10d keeps as is), so it answers for itself."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        dist.ProcessGroup.__init__(self, rank, size)
        self._setup(store, dist.ProcessGroupGloo(dist.PrefixStore("fake-hccl", store), rank, size, timeout))

    def _get_backend(self, device) -> FakeHcclGroup:
        device = torch.device(device)
        if device.type != "npu":
            raise RuntimeError(f"No backend type associated with device type {device.type}")
        return self


class _GlooBase:
    """A standalone group's own gloo base, called as FakeHcclGroup calls its inner gloo group (the class
    overrides send, recv and the collectives with HCCL's behaviour, which then reach gloo's through this)."""

    def __init__(self, group: dist.ProcessGroupGloo):
        self._group = group

    def __getattr__(self, name: str):
        method = getattr(dist.ProcessGroupGloo, name)
        return lambda *args, **kwargs: method(self._group, *args, **kwargs)


class ProcessGroupHCCL(_Hccl, dist.ProcessGroupGloo):
    """torch_npu._C._distributed_c10d.ProcessGroupHCCL constructed standalone, outside c10d's registry, as
    afd's per-pair worlds make it. Where the wheel reaches it (torch_npu 2.14.0: _init/registry/distributed.py
    builds it as ProcessGroupHCCL(store, group_rank, group_size, ProcessGroupHCCL.Options()), and nothing sets
    torch.distributed.ProcessGroupHCCL); what it is: a c10d Backend, the object `group._get_backend(npu)`
    returns (_compat/distributed.py checks isinstance(backend, ProcessGroupHCCL)). So, like the real one, it
    has no `_get_backend`, which only a registered group's ProcessGroup wrapper has. Its base is gloo's
    Backend, which moves the bytes (a Python class cannot derive from c10d's Backend directly: no constructor
    is bound)."""

    class Options:
        """ProcessGroupHCCL.Options: only the fields the wheel's own Python sets (the registry helper above)."""

        __slots__ = ("_timeout", "is_high_priority_stream", "global_ranks_in_group", "group_id")

        def __init__(self):
            self._timeout = timedelta(minutes=30)
            self.is_high_priority_stream = False
            self.global_ranks_in_group: list[int] = []
            self.group_id = ""

    def __init__(self, store, rank: int, size: int, options: ProcessGroupHCCL.Options):
        if not isinstance(options, ProcessGroupHCCL.Options):
            raise TypeError(f"ProcessGroupHCCL(store, rank, size, options): options is a {type(options).__name__}")
        dist.ProcessGroupGloo.__init__(self, dist.PrefixStore("fake-hccl", store), rank, size, options._timeout)
        self._hccl_options = options  # the fake's own record (whether the real class shows its options is unread)
        self._setup(store, _GlooBase(self))


def _create(store, rank: int, size: int, timeout: timedelta) -> FakeHcclGroup:
    return FakeHcclGroup(store, rank, size, timeout)


_registered = False


def install() -> None:
    global _registered
    if not _registered:
        dist.Backend.register_backend("hccl", _create, devices=["npu"])
        _registered = True
