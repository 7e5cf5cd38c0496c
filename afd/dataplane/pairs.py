"""One attention–FFN pair's own two-rank world: the data plane is made of these, one per pair, and no
torch.distributed world spans the cluster (docs/architecture/dataplane.md, "Pairs").

A PairLink is two standalone groups (`Backend.pair_group`: one per direction, for the reason
afd/dataplane/transport.py's docstring gives) formed through the FFN node's rendezvous store under a key
that the attention rank draws afresh for each formation and hands over on the authenticated control
plane (the FFN node's `Pairs` service, ffn_node/pairs.py). No other process takes part, so a pair forms
and re-forms while every other pair keeps stepping. Rank 0 of a pair is the attention side, rank 1 the
FFN side.
"""

from __future__ import annotations

import gc
import hashlib
import hmac
import logging
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from afd.backend import Backend, host_syncs
from afd.backend.base import PeerError
from afd.dataplane.rendezvous import apply_comm_env

log = logging.getLogger("afd.dataplane.pairs")
ATTENTION, FFN = 0, 1
_SIDE = {ATTENTION: "attention", FFN: "ffn"}


class PairLink:
    def __init__(self, backend: Backend, store, key: str, rank: int, timeout_s: float):
        """store: the FFN node's rendezvous store (afd.dataplane.rendezvous.ControlStore), which the caller
        keeps referenced while the link lives; key: this formation's, fresh each time."""
        assert rank in (ATTENTION, FFN)
        self.backend, self.rank, self.peer, self.key = backend, rank, 1 - rank, key
        # Where a watchdog holds the deadlines (NCCL, HCCL), the groups' own timeout is a backstop past it: a
        # transfer the group timed out first would end as a hang-like failure, not as the deadline's PeerError.
        group_s = timeout_s * 2 + 10 if backend.stream_ordered_waits else timeout_s
        apply_comm_env(backend)
        # formed in one order on both ends: a gloo group's constructor blocks until the peer's connects
        names = [f"afd/pair/{key}/{d}" for d in ("to-ffn", "to-attention")]
        self._stores = [dist.PrefixStore(f"{name}/", store) for name in names]
        self.to_ffn, self.to_attention = (
            backend.pair_group(s, rank, timedelta(seconds=group_s), name) for s, name in zip(self._stores, names)
        )
        self.formed_at = time.monotonic()
        self.experts: tuple[int, ...] = ()
        """On an attention rank's end: the routed experts the FFN node said it holds when the pair formed."""
        self._mu = threading.Lock()
        self._closed = False
        """close() ran: an abort from another thread that comes after it (DataPlane aborts outside its lock)
        finds nothing to act on."""

    def isend(self, tensor: torch.Tensor):
        group = self.to_ffn if self.rank == ATTENTION else self.to_attention
        return group.send([tensor], self.peer, 0)

    def irecv(self, tensor: torch.Tensor):
        group = self.to_attention if self.rank == ATTENTION else self.to_ffn
        return group.recv([tensor], self.peer, 0)

    def abort(self) -> None:
        """Both directions' communicators, without waiting for queued work (Backend.abort_group); any thread.
        Nothing once the pair is closed: its groups are shut down or aborted already."""
        with self._mu:
            if not self._closed:
                self._abort_groups()

    def _abort_groups(self) -> None:
        # The group this end receives on first: NCCL's abort of one communicator can block on a kernel still
        # pending on another of the device (pytorch issue #119797, PR #150690), and what never completes
        # after the peer died is this end's receive (the attention rank's output, the FFN node's input).
        receives, sends = (
            (self.to_attention, self.to_ffn) if self.rank == ATTENTION else (self.to_ffn, self.to_attention)
        )
        for group in (receives, sends):
            try:
                self.backend.abort_group(group)
            except Exception as e:  # an abort that fails leaves nothing worse than the failure it follows
                log.warning("aborting a pair's group: %s", first_line(e))

    def close(self, queued: bool) -> None:
        """Ends the pair. queued: work may still sit on its streams (an op not waited for, a failure): where
        tearing a group down waits for that (NCCL, HCCL), the pair is aborted and its groups forgotten, never
        shut down; otherwise each group is shut down (NCCL's finalize flushes what is in flight)."""
        with self._mu:
            if self._closed:
                return
            self._closed = True
            if queued and self.backend.shutdown_waits_for_queued_work:
                self._abort_groups()
            else:
                for group in (self.to_ffn, self.to_attention):
                    try:
                        group.shutdown()
                    except Exception as e:  # a dead peer can make teardown fail; going on matters more
                        log.debug("pair group shutdown: %s", first_line(e))
            del self.to_ffn, self.to_attention
        # pending works in dropped frames keep a gloo group (and its sockets) alive until collected: the
        # peer, blocked on this end, notices only once they close
        gc.collect()


def handshake(link: PairLink, token: str | None, timeout_s: float) -> None:
    """Each end proves to the other that it holds the cluster token (HMAC over the formation's key), so a
    process that took the pair's place through a leaked key is refused before any tensor moves. Both ends
    post their ops in one order (the attention side's send first), since a communicator forms at its first
    op, blocking until the other end's (HCCL's HcclCommInitRootInfo, NCCL's lazy init). Off the hot path:
    the host polls the transfers up to the deadline, then reads the peer's digest."""
    device = link.backend.device
    secret = (token or link.key).encode()

    def digest(src: int, dst: int) -> torch.Tensor:
        msg = f"afd/{link.key}/{_SIDE[src]}->{_SIDE[dst]}".encode()
        d = hmac.new(secret, msg, hashlib.sha256).digest()
        return torch.frombuffer(bytearray(d), dtype=torch.uint8).to(device)

    mine, theirs = digest(link.rank, link.peer), torch.empty(32, dtype=torch.uint8, device=device)
    if link.rank == ATTENTION:
        works = [link.isend(mine), link.irecv(theirs)]
    else:
        works = [link.irecv(theirs), link.isend(mine)]
    deadline = time.monotonic() + timeout_s
    late = PeerError(f"data plane: the pair's handshake did not complete within {timeout_s:.0f}s")
    for w in works:
        try:
            if link.backend.stream_ordered_waits:  # the host polls (off the hot path); a wait would not block
                while not _completed(w):
                    if time.monotonic() > deadline:
                        link.abort()
                        raise late
                    time.sleep(0.002)
                w.wait()
            elif w.wait(timedelta(seconds=max(0.0, deadline - time.monotonic()))) is False:  # gloo: blocks
                raise late
        except RuntimeError as e:
            if e is late:
                raise
            raise PeerError(f"data plane: the pair's handshake failed ({first_line(e)})") from None
    host_syncs.note(theirs.device)
    if not hmac.compare_digest(bytes(theirs.cpu().tolist()), bytes(digest(link.peer, link.rank).cpu().tolist())):
        raise PeerError(
            f"data plane: the {_SIDE[link.peer]} end of the pair failed the handshake: it does not hold this "
            "cluster's token (AFD_CLUSTER_TOKEN)"
        )


def _completed(work) -> bool:
    try:
        return bool(work.is_completed())
    except RuntimeError:  # a failed work is done: wait() raises its error
        return True


def first_line(e: BaseException) -> str:
    """An error in one line (a gloo error runs to several)."""
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__
