"""The data plane: point-to-point device tensors over torch.distributed process groups.

gloo on CPU, NCCL on CUDA, HCCL on NPU. Every message is a tensor on the node's device (headers too:
NCCL and HCCL groups take device tensors only). Ops are issued from the thread that computed the
tensors, with that thread's current stream: the process group orders its own communication stream after
it and keeps the tensor alive for the transfer, so no side stream is needed (docs/architecture.md,
"Devices, streams and timeouts").

Two groups per pair of peers, one per direction: messages from the lower rank to the higher go on one, the
other way on the other. NCCL and HCCL run a pair's sends and receives on one stream in issue order, so with
one group a send queued behind a pending receive (ping-pong's next micro-batch behind the last one's
result). And one pair per group, because NCCL's and HCCL's aborts act on a whole group: aborting the pair
of a failed peer leaves every other pair working, and no communicator spans more than two ranks (so none
needs the other ranks to form it, whatever P2P_HCCL_BUFFSIZE says).

Every wait has a deadline that holds, and a failed or timed-out op raises PeerError naming the peer. On
gloo a wait blocks the host, with the group's timeout. On NCCL and HCCL it is stream-ordered (the current
stream waits for the transfer; the host does not), and afd.backend.deadlines' watchdog holds the
deadline: it aborts the peer's pair when one passes, and the owner meets the PeerError at its next wait
or `check()`. Teardown never waits on work that may still be queued: NCCL's and HCCL's shutdown() would
(docs/architecture/dataplane.md, "Failures and teardown").
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
from afd.backend.base import PeerError  # noqa: F401 (re-exported: defined below the model's TP group too)
from afd.backend.deadlines import Deadlines
from afd.dataplane.deadlines import plane_error
from afd.dataplane.rendezvous import apply_comm_env, bind_gloo

log = logging.getLogger("afd.dataplane.transport")


class DataPlane:
    """One generation of the data plane. A node that is replaced makes every node form the next
    generation: same ranks, its own key prefix in the same store."""

    def __init__(
        self,
        backend: Backend,
        rank: int,
        world_size: int,
        store,
        generation: int = 0,
        timeout_s: float = 60.0,
        formation: str = "",
        bind_host: str | None = None,
        peers: list[int] | None = None,
    ):
        """formation: the secret part of this generation's store prefix, handed out over the (token-
        authenticated) control plane, so a process that only reaches the store cannot join it.
        peers: the ranks this one exchanges with (None: every other rank). Every rank makes every pair's
        groups in one order, so all ranks must agree on the pairs: afd's are every attention rank with
        every FFN rank, i.e. this rank's side (the ranks that are not its peers) times its peers."""
        self.backend, self.rank, self.world_size, self.generation = backend, rank, world_size, generation
        self.timeout = timedelta(seconds=timeout_s)
        # Where the watchdog holds the deadlines, the groups' own timeout is a backstop past it: a transfer
        # that the group timed out first would end as a hang-like failure, not as the deadline's PeerError.
        group_timeout = self.timeout * 2 + timedelta(seconds=10) if backend.stream_ordered_waits else self.timeout
        self.peers = sorted(peers) if peers is not None else [r for r in range(world_size) if r != rank]
        pairs = _pairs(world_size, None if peers is None else self.peers, rank)
        self._pairs: dict[int, tuple] = {}
        """peer -> (group carrying the lower rank's messages to the higher, group for the other way)."""
        self._aborted: dict[int, str] = {}
        """Peers whose pair was aborted, and why: their ops are refused, their waits fail."""
        self._abort_lock = threading.Lock()
        self._outstanding = 0
        """Ops issued and not yet waited for successfully: work that may still be queued (owner thread only)."""
        self._errors_before = PeerError.made
        """PeerErrors made in this process before this generation: any made since means a failure here, on
        the plane or in a TP group of its world, whose collective may be queued."""
        t0 = time.monotonic()
        apply_comm_env(backend)
        if backend.dist_backend == "gloo":
            bind_gloo(bind_host)
        dist.init_process_group(
            backend.dist_backend,
            store=dist.PrefixStore(f"afd/g{generation}/{formation}", store),
            rank=rank,
            world_size=world_size,
            timeout=group_timeout,
        )
        for lo, hi in pairs:  # every rank makes every pair's groups, in one order: c10d numbers them
            up, down = (dist.new_group([lo, hi], timeout=group_timeout, backend=backend.dist_backend) for _ in range(2))
            if rank in (lo, hi):
                self._pairs[hi if rank == lo else lo] = (up, down)
        self.deadlines = (
            Deadlines(timeout_s, lambda p: self._abort_pair(p, "its deadline passed"), plane_error)
            if backend.stream_ordered_waits
            else None
        )
        log.info(
            "data plane up: rank %d of %d over %s, generation %d, %d pair(s), in %.2fs",
            rank,
            world_size,
            backend.dist_backend,
            generation,
            len(self._pairs),
            time.monotonic() - t0,
        )

    def handshake(self, peers: list[int], token: str | None, formation: str) -> None:
        """Each pair of peers proves to the other that it holds the cluster token: a process that took
        a rank through a leaked store prefix cannot answer, and is refused before any tensor moves.
        Every op is posted before any is waited for, pair by pair in ascending order and the lower rank's
        send first on both ends: a communicator that forms at its first op, blocking until the other end's
        first op (HCCL's HcclCommInitRootInfo inside getHCCLComm), therefore forms in one global order, and
        no rank blocks on one pair while the other end of another waits for it."""
        key = (token or formation).encode()

        def digest(src: int, dst: int) -> torch.Tensor:
            d = hmac.new(key, f"afd/{formation}/{src}->{dst}".encode(), hashlib.sha256).digest()
            return torch.frombuffer(bytearray(d), dtype=torch.uint8).to(self.backend.device)

        posted = []
        for p in sorted(peers):
            mine, theirs = digest(self.rank, p), torch.empty(32, dtype=torch.uint8, device=self.backend.device)
            ops = [(self.isend, mine), (self.irecv, theirs)]
            posted.append((p, theirs, mine, [op(t, p) for op, t in (ops if self.rank < p else ops[::-1])]))
        for p, theirs, _, works in posted:
            for w in works:
                self.wait(w, p, "handshake")
            host_syncs.note(theirs.device)
            if not hmac.compare_digest(bytes(theirs.cpu().tolist()), bytes(digest(p, self.rank).cpu().tolist())):
                raise PeerError(
                    f"data plane: rank {p} failed the handshake: it does not hold this cluster's "
                    "token (AFD_CLUSTER_TOKEN)",
                    p,
                )

    def _group(self, peer: int, low_to_high: bool):
        pair = self._pairs.get(peer)
        if pair is None:
            raise PeerError(f"data plane: rank {peer} is not a peer of rank {self.rank}", peer)
        return pair[0] if low_to_high else pair[1]

    def _issue(self, op, tensor: torch.Tensor, peer: int, low_to_high: bool):
        why = self._aborted.get(peer)
        if why is not None:
            raise PeerError(f"data plane: {op.__name__} to rank {peer} refused: its pair was aborted ({why})", peer)
        group = self._group(peer, low_to_high)
        try:
            work = op(tensor, peer, group=group)
        except RuntimeError as e:  # gloo refuses to post on a pair whose peer is already gone
            err = PeerError(
                f"data plane: {op.__name__} to rank {peer} failed ({_first_line(e)}); "
                f"the peer process is probably gone",
                peer,
            )
        else:
            self._outstanding += 1
            return work
        self._abort_pair(peer, str(err))
        raise err

    def isend(self, tensor: torch.Tensor, peer: int):
        return self._issue(dist.isend, tensor, peer, low_to_high=peer > self.rank)

    def irecv(self, tensor: torch.Tensor, peer: int):
        return self._issue(dist.irecv, tensor, peer, low_to_high=self.rank > peer)

    def wait(self, work, peer: int, what: str) -> None:
        if self.deadlines is not None:
            self.deadlines.check(peer)  # another peer's passed deadline is that peer's wait's, or check()'s
        if peer in self._aborted:
            raise self._aborted_error(peer, what)
        ordered = self.deadlines is not None
        err = self._wait_stream_ordered(work, peer, what) if ordered else self._wait_blocking(work, peer, what)
        if err is None:
            self._outstanding -= 1  # on NCCL/HCCL the watchdog knows whether it is still queued on the device
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
            return PeerError(f"data plane: {what} with rank {peer} failed ({_first_line(e)})", peer)
        return None

    def _wait_blocking(self, work, peer: int, what: str) -> PeerError | None:
        """gloo: the host waits, up to the group's timeout."""
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as e:
            return PeerError(
                f"data plane: {what} with rank {peer} failed ({_first_line(e)}); the peer process is probably gone",
                peer,
            )
        if ok is False:
            return PeerError(
                f"data plane: {what} with rank {peer} timed out after {self.timeout.total_seconds():.0f}s", peer
            )
        return None

    def _aborted_error(self, peer: int, what: str) -> PeerError:
        why = self._aborted[peer]
        return PeerError(f"data plane: {what} with rank {peer} failed: its pair was aborted ({why})", peer)

    def abort(self, peer: int | None = None, why: str = "DataPlane.abort") -> None:
        """Aborts the communicators of the pair with `peer` (every pair with None) without waiting for the
        work queued on them; later ops with that peer are refused and its waits fail with PeerError.
        Safe from any thread, also while the owner thread is blocked in a wait: on NCCL (and the fake
        HCCL) that wait then fails at once; on gloo, and on a real HCCL as far as torch_npu's source shows,
        it still runs to its timeout (or the peer's sockets closing), then fails with PeerError."""
        for p in list(self._pairs) if peer is None else [peer]:
            self._abort_pair(p, why)

    def aborted(self, peer: int) -> bool:
        return peer in self._aborted

    def _abort_pair(self, peer: int, why: str) -> None:
        with self._abort_lock:
            pair = self._pairs.get(peer)  # under the lock: close() may empty the pairs from another thread
            if peer in self._aborted or pair is None:
                return
            self._aborted[peer] = why  # first: the owner refuses new ops on the pair from here on
        for group in pair:
            try:
                self.backend.abort_group(group)
            except Exception as e:  # an abort that fails leaves nothing worse than the failure it follows
                log.warning("data plane: aborting the pair with rank %d: %s", peer, _first_line(e))
        log.info("data plane generation %d: pair with rank %d aborted (%s)", self.generation, peer, why)

    def check(self) -> None:
        """Raises the PeerError of a deadline the watchdog saw pass (stream-ordered waits only): call it after
        a host read of results that a transfer fed, since an aborted transfer leaves garbage behind."""
        if self.deadlines is not None:
            self.deadlines.check()

    def close(self) -> None:
        """Leaves this generation, and every process group of its world (an attention node's TP groups too).
        Where tearing a group down waits for its queued work (NCCL, HCCL) and work may be queued (an op not
        waited for, a pair aborted, any PeerError in this process since the plane formed), every pair is
        aborted and all groups are forgotten without shutdown(); otherwise they are destroyed as usual."""
        if self.deadlines is not None:
            self.deadlines.close()
        if not dist.is_initialized():
            return
        queued = self._outstanding > 0 or bool(self._aborted) or PeerError.made > self._errors_before
        queued = queued or (self.deadlines is not None and self.deadlines.pending > 0)
        abort = self.backend.shutdown_waits_for_queued_work and queued
        try:
            if abort:
                self.abort()
                dist.distributed_c10d._abort_process_group()  # forgets every group; no shutdown(), no wait
            else:
                dist.destroy_process_group()
        except Exception as e:  # a dead peer can make teardown fail; exiting matters more
            # (after an abort that failed, the next generation may not form: say so)
            log.log(logging.WARNING if abort else logging.DEBUG, "process group teardown: %s", e)
        with self._abort_lock:  # an abort from the heartbeat thread finds no pair left to abort
            self._pairs = {}
        # pending works in dropped frames keep the group (and its sockets) alive until collected;
        # peers blocked on this node notice only once the sockets close
        gc.collect()


def _pairs(world_size: int, peers: list[int] | None, rank: int) -> list[tuple[int, int]]:
    """Every pair of ranks that exchange, (lower, higher), in ascending order: this rank's side (itself and
    the ranks that are not its peers) times its peers; with peers None, every pair of ranks."""
    if peers is None:
        return [(a, b) for a in range(world_size) for b in range(a + 1, world_size)]
    side = [r for r in range(world_size) if r not in peers]
    assert rank in side
    return sorted({(min(a, b), max(a, b)) for a in side for b in peers})


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__
