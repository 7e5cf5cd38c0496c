"""The data plane: point-to-point device tensors over torch.distributed process groups, one pair of
groups per attention–FFN pair in a world of its own (afd.dataplane.pairs).

gloo on CPU, NCCL on CUDA, HCCL on NPU. Every message is a tensor on the node's device (headers too:
NCCL and HCCL groups take device tensors only). Ops are issued from the thread that computed the
tensors, with that thread's current stream: the process group orders its own communication stream after
it and keeps the tensor alive for the transfer, so no side stream is needed (docs/architecture.md,
"Devices, streams and timeouts").

Two groups per pair of peers, one per direction (attention to FFN, FFN to attention). NCCL and HCCL run a
pair's sends and receives on one stream in issue order, so with one group a send queued behind a pending
receive (ping-pong's next micro-batch behind the last one's result). And one pair per group, because
NCCL's and HCCL's aborts act on a whole group: aborting the pair of a failed peer leaves every other pair
working, and no communicator spans more than two ranks (so none needs the other ranks to form it,
whatever P2P_HCCL_BUFFSIZE says). A pair forms, and re-forms, without any other process taking part.

Every wait has a deadline that holds, and a failed or timed-out op raises PeerError naming the peer. On
gloo a wait blocks the host, with the group's timeout. On NCCL and HCCL it is stream-ordered (the current
stream waits for the transfer; the host does not), and afd.backend.deadlines' watchdog holds the
deadline: it aborts the peer's pair when one passes, and the owner meets the PeerError at its next wait
or `check()`. Teardown never waits on work that may still be queued: NCCL's and HCCL's shutdown() would
(docs/architecture/dataplane.md, "Failures and teardown").
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import torch

from afd.backend import Backend
from afd.backend.base import PeerError  # noqa: F401 (re-exported: defined below the model's TP group too)
from afd.backend.deadlines import Deadlines
from afd.dataplane.deadlines import plane_error
from afd.dataplane.pairs import PairLink, first_line

log = logging.getLogger("afd.dataplane.transport")


class DataPlane:
    """This process's end of the data plane: one pair (afd.dataplane.pairs.PairLink) per peer rank, each
    added, replaced and dropped on its own while the others keep working. Ops, waits, `add`, `drop` and
    `close` belong to the owner thread; `abort` may come from any thread."""

    def __init__(self, backend: Backend, rank: int, timeout_s: float = 60.0):
        self.backend, self.rank = backend, rank
        self.timeout = timedelta(seconds=timeout_s)
        self._links: dict[int, PairLink] = {}
        self._aborted: dict[int, str] = {}
        """Peers whose pair was aborted, and why: their ops are refused, their waits fail."""
        self._abort_lock = threading.Lock()
        self._outstanding: dict[int, int] = {}
        """Per peer, ops issued and not yet waited for successfully: work that may still be queued."""
        self._blocked: dict[int, float] = {}
        """Per peer, when the owner's blocking wait on it began (gloo), while it lasts."""
        self._errors_since: dict[int, int] = {}
        """PeerError.made when each pair was added: any made since means a failure in this process (on the
        plane, or in a TP group) whose work may be queued."""
        self.deadlines = (
            Deadlines(timeout_s, lambda p: self._abort_pair(p, "its deadline passed"), plane_error)
            if backend.stream_ordered_waits
            else None
        )

    @property
    def peers(self) -> list[int]:
        return sorted(self._links)

    def add(self, peer: int, link: PairLink) -> None:
        """Takes a formed (and handshaken) pair with `peer` into use, in place of the peer's old one."""
        if peer in self._links:
            self.drop(peer)
        with self._abort_lock:
            self._links[peer] = link
            self._aborted.pop(peer, None)
        self._outstanding[peer] = 0
        self._errors_since[peer] = PeerError.made

    def link(self, peer: int) -> PairLink | None:
        return self._links.get(peer)

    def drop(self, peer: int) -> None:
        """Ends the pair with `peer` (its later ops are refused), aborting it where work may be queued."""
        with self._abort_lock:
            link = self._links.pop(peer, None)
            failed = peer in self._aborted
            self._aborted.setdefault(peer, "dropped")
        if link is None:
            return
        queued = failed or self._outstanding.pop(peer, 0) > 0 or PeerError.made > self._errors_since.pop(peer, 0)
        if self.deadlines is not None:
            queued = self.deadlines.forget(peer) or queued
        link.close(queued)

    def _issue(self, name: str, tensor: torch.Tensor, peer: int):
        why = self._aborted.get(peer)
        if why is not None:
            raise PeerError(f"data plane: {name} to rank {peer} refused: its pair was aborted ({why})", peer)
        link = self._links.get(peer)
        if link is None:
            raise PeerError(f"data plane: rank {peer} is not a peer of rank {self.rank}", peer)
        try:
            work = getattr(link, name)(tensor)
        except RuntimeError as e:  # gloo refuses to post on a pair whose peer is already gone
            err = PeerError(
                f"data plane: {name} to rank {peer} failed ({first_line(e)}); the peer process is probably gone",
                peer,
            )
        else:
            self._outstanding[peer] += 1
            return work
        self._abort_pair(peer, str(err))
        raise err

    def isend(self, tensor: torch.Tensor, peer: int):
        return self._issue("isend", tensor, peer)

    def irecv(self, tensor: torch.Tensor, peer: int):
        return self._issue("irecv", tensor, peer)

    def wait(self, work, peer: int, what: str) -> None:
        if self.deadlines is not None:
            self.deadlines.check(peer)  # another peer's passed deadline is that peer's wait's, or check()'s
        if peer in self._aborted:
            raise self._aborted_error(peer, what)
        ordered = self.deadlines is not None
        err = self._wait_stream_ordered(work, peer, what) if ordered else self._wait_blocking(work, peer, what)
        if err is None:
            if peer in self._outstanding:  # on NCCL/HCCL the watchdog knows whether it is still queued
                self._outstanding[peer] -= 1
            return
        if peer in self._aborted:  # aborted while this wait ran: that is the cause, and what arrived may be torn
            err = self._aborted_error(peer, what)
        self._abort_pair(peer, str(err))
        raise err

    def _wait_stream_ordered(self, work, peer: int, what: str) -> PeerError | None:
        """The current stream waits for the transfer and the host goes on; the watchdog holds the deadline."""
        assert self.deadlines is not None
        self.deadlines.watch(work, peer, what)
        try:
            work.wait()
        except RuntimeError as e:  # the watchdog's abort, or the communicator's own error
            self.deadlines.check(peer)  # a passed deadline raises its own error, which names the timeout
            return PeerError(f"data plane: {what} with rank {peer} failed ({first_line(e)})", peer)
        return None

    def _wait_blocking(self, work, peer: int, what: str) -> PeerError | None:
        """gloo: the host waits, up to the group's timeout, or until an abort shuts the pair's connections."""
        self._blocked[peer] = time.monotonic()
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as e:
            return PeerError(
                f"data plane: {what} with rank {peer} failed ({first_line(e)}); the peer process is probably gone",
                peer,
            )
        finally:
            self._blocked.pop(peer, None)
        if ok is False:
            return PeerError(
                f"data plane: {what} with rank {peer} timed out after {self.timeout.total_seconds():.0f}s", peer
            )
        return None

    def waiting_on(self, peer: int) -> float:
        """Seconds this end has been waiting on `peer` (any thread): its owner blocked in a wait on it (gloo), or
        its oldest transfer with it still incomplete (NCCL, HCCL); 0 when it waits on nothing of the peer's."""
        since = self.deadlines.oldest(peer) if self.deadlines is not None else self._blocked.get(peer)
        return 0.0 if since is None else time.monotonic() - since

    def _aborted_error(self, peer: int, what: str) -> PeerError:
        why = self._aborted[peer]
        return PeerError(f"data plane: {what} with rank {peer} failed: its pair was aborted ({why})", peer)

    def abort(self, peer: int | None = None, why: str = "DataPlane.abort") -> None:
        """Aborts the communicators of the pair with `peer` (every pair with None) without waiting for the
        work queued on them; later ops with that peer are refused and its waits fail with PeerError.
        Safe from any thread, also while the owner thread is blocked in a wait: on NCCL (and the fake
        HCCL) that wait then fails at once; on gloo, and on a real HCCL as far as torch_npu's source shows,
        it still runs to its timeout (or the peer's sockets closing), then fails with PeerError."""
        for p in list(self._links) if peer is None else [peer]:
            self._abort_pair(p, why)

    def aborted(self, peer: int) -> bool:
        return peer in self._aborted

    def abort_link(self, peer: int, link: PairLink, why: str) -> None:
        """Aborts the pair with `peer` if `link` is still that pair (any thread): a pair formed since stays."""
        self._abort_pair(peer, why, link)

    def _abort_pair(self, peer: int, why: str, link: PairLink | None = None) -> None:
        with self._abort_lock:
            current = self._links.get(peer)  # under the lock: the owner may replace or drop the pair
            if peer in self._aborted or current is None or (link is not None and current is not link):
                return
            self._aborted[peer] = why  # first: the owner refuses new ops on the pair from here on
        current.abort()
        log.info("data plane: pair with rank %d aborted (%s)", peer, why)

    def check(self) -> None:
        """Raises the PeerError of a deadline the watchdog saw pass (stream-ordered waits only): call it after
        a host read of results that a transfer fed, since an aborted transfer leaves garbage behind."""
        if self.deadlines is not None:
            self.deadlines.check()

    def close(self) -> None:
        """Ends every pair (aborting those whose work may be queued, where teardown would wait for it)."""
        for peer in list(self._links):
            self.drop(peer)
        if self.deadlines is not None:
            self.deadlines.close()
