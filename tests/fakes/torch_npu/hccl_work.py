"""The fake HCCL group's works: how wait() behaves, and what a transfer whose peer died does.

source: Ascend/pytorch (torch_npu) master @9e73e70, 2026-08-21 (hccl.py names the rest):
- torch_npu/csrc/distributed/ProcessGroupHCCL.cpp, `WorkHCCL::synchronizeInternal`: wait() makes the current
  stream wait for the work; the host blocks, and the timeout applies, only with TORCH_HCCL_BLOCKING_WAIT=1 or
  HCCL_BLOCKING_WAIT=1
  (ProcessGroupHCCL.hpp: `TORCH_HCCL_BLOCKING_WAIT = {"TORCH_HCCL_BLOCKING_WAIT", "HCCL_BLOCKING_WAIT"}`).
  Without it, a dead peer hangs the first host read of the result.
- `WorkHCCL::synchronizeInternal` / `WorkHCCL::abort`: a blocking wait that times out destroys the
  communicators of that work only (for a point-to-point op, the pair's), not the group's others.

A dead peer: HCCL has no liveness signal on HCCS (nor NCCL on NVLink): a transfer whose peer died (or hung)
is a task that never completes on its stream; nothing fails. The fake does the same with a point-to-point
transfer whose gloo op failed, at issue or later (the peer's sockets closed: kill -9): it never completes, so
only an abort or the deadline of the wait ends it, and not gloo's fast failure (afd/node/runtime.py aborts a
peer's pair when the control plane reports it lost).
"""

from __future__ import annotations

import os
import queue
import threading
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import device as npu

if TYPE_CHECKING:
    from .hccl import _Hccl

HANG_S = float(os.environ.get("AFD_FAKE_HANG_S", "20"))
"""How long the fake lets a wait that a real HCCL would never end run before it says so."""


class HangError(RuntimeError):
    """A real HCCL would block here forever."""


def _blocking_wait() -> bool:
    return any(
        os.environ.get(k, "0").lower() in ("1", "true", "yes", "y")
        for k in ("TORCH_HCCL_BLOCKING_WAIT", "HCCL_BLOCKING_WAIT")
    )


class _Work(dist.Work):
    def __init__(self, pg: _Hccl, inner, stream: npu.Stream, seq: int, kind: str, peer: int):
        """The transfer is waited for on its stream's runner thread, so that an abort from another thread ends
        a wait on it at once, collectives included (gloo finishes a collective in its wait(): the runner
        takes the issuing thread's inference mode for it)."""
        super().__init__()
        self._inference = torch.is_inference_mode_enabled()
        self.pg, self._payload, self.stream, self.seq, self.kind, self.peer = pg, inner, stream, seq, kind, peer
        self._done = False
        self._ran = threading.Event()
        """Set once gloo finished the transfer; a collective also once gloo failed it (`_error`), a
        point-to-point transfer never then (its peer died: see the module docstring)."""
        self._error: str | None = None
        self._wake = threading.Event()
        """Set when the transfer ran or the group was aborted: what a wait() waits for."""

    def _run(self, limit: timedelta | None = None) -> None:
        """On the stream's runner thread, in issue order (an HCCL stream runs its tasks in order)."""
        if self._payload is None:  # its peer was already gone when it was issued: it never completes
            return
        try:
            with torch.inference_mode(self._inference):
                if limit is None:
                    self._payload.wait()  # bounded by the group's timeout, as gloo's own ops are
                else:
                    self._payload.wait(limit)
        except RuntimeError as e:
            self._error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if self.peer >= 0:  # a dead peer's transfer never completes on an HCCL stream (module docstring)
                return
        self._ran.set()
        self._wake.set()

    def is_completed(self) -> bool:
        return self._done or self._ran.is_set() or self.pg._aborted is not None

    def _stuck(self) -> bool:
        """Never completed on the wire: a real HCCL task that would still sit on its stream."""
        return not self._ran.is_set() or self._error is not None

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        blocking = _blocking_wait()
        limit = timeout if blocking and timeout.total_seconds() > 0 else timedelta(seconds=HANG_S)
        # The transfer is waited for on the stream's runner thread, so that an abort from another thread
        # ends this wait at once (a gloo wait cannot be interrupted, and one that times out closes its pair).
        self._wake.wait(limit.total_seconds())
        if self.pg._aborted is not None and not (self._ran.is_set() and self._error is None):
            raise RuntimeError(
                f"[Rank {self.pg.rank()}] Work {self.kind} with rank {self.pg._global(self.peer)} failed: the "
                f"group's HCCL communicators were aborted ({self.pg._aborted})"
            )
        if not self._ran.is_set() or self._error is not None:
            if not blocking:
                raise HangError(
                    f"fake hccl: {self.kind} with rank {self.peer} never completed; a real HCCL "
                    "wait() ignores its timeout unless HCCL_BLOCKING_WAIT=1 (or "
                    "TORCH_HCCL_BLOCKING_WAIT=1), so this process would hang here"
                )
            why = self._error or f"not completed after {limit.total_seconds():.0f}s"
            raise RuntimeError(
                f"[Rank {self.pg.rank()}] Work {self.kind} timed out in blocking wait "
                f"(TORCH_HCCL_BLOCKING_WAIT=1 or HCCL_BLOCKING_WAIT=1): {why}"
            )
        self._done = True
        self.pg._finished(self)
        with npu._lock:
            npu.current_stream(self.stream.device_index)._merge(self.stream.clock)
            if blocking:
                npu.host_sync(f"blocking {self.kind} wait")
                npu._host_waits(self.stream)
        return True


def _runner(tasks: queue.SimpleQueue) -> None:
    """One stream's tasks, in order; None ends it."""
    while (work := tasks.get()) is not None:
        work._run()
        del work  # hold no group alive between tasks
