"""An attention rank forming its pairs of the data plane, one FFN node at a time, through that FFN node's
`Pairs` service (ffn_node/pairs.py) and rendezvous store: at start-up and after a failure of its own,
while every other pair of the cluster keeps stepping (docs/architecture/dataplane.md, "Pairs")."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import grpc

from afd.cluster.token import cluster_token
from afd.config.schema import ClusterConfig
from afd.control import control_pb2 as pb
from afd.control import control_pb2_grpc as pb_grpc
from afd.control.auth import call_metadata, channel
from afd.control.client import ControlError
from afd.dataplane.pairs import ATTENTION, PairLink, first_line, handshake
from afd.dataplane.rendezvous import ControlStore
from afd.dataplane.transport import DataPlane, PeerError

log = logging.getLogger("afd.node")
_NOT_YET = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED)
"""An FFN node that is down, loading, or whose side of a formation failed: tried again until the deadline."""


class FFNPeer:
    """One FFN node as an attention rank reaches it: its Pairs service and its rendezvous store."""

    def __init__(self, cfg: ClusterConfig, rank: int, timeout_s: float):
        self.rank, self.timeout_s = rank, timeout_s
        proc = cfg.processes[rank]
        self.name, self.address = proc.name, f"{proc.node.host}:{proc.node.ports.control}"
        self._channel = channel(self.address, cfg.cluster.tls)
        self.stub = pb_grpc.PairsStub(self._channel)
        self.store = ControlStore(self.address, timeout_s, cfg.cluster.tls)
        """Kept referenced for as long as a pair formed through it lives (c10d holds only its C++ half)."""

    def form(self, backend, me: pb.NodeRef, my_rank: int) -> PairLink:
        """One formation: the FFN node accepts it (or refuses: grpc.RpcError), then both ends form the
        pair's groups under a fresh key and prove the token over them."""
        key = secrets.token_hex(16)
        req = pb.PairRequest(
            name=me.name, instance_id=me.instance_id, rank=my_rank, key=key, timeout_seconds=self.timeout_s
        )
        reply = self.stub.FormPair(req, metadata=call_metadata(), timeout=10)
        link = PairLink(backend, self.store, key, ATTENTION, self.timeout_s)
        link.experts = tuple(reply.experts)
        try:
            handshake(link, cluster_token(), self.timeout_s)
        except BaseException:
            link.close(queued=True)
            raise
        return link

    def close(self) -> None:
        self.store.close()
        self._channel.close()


FORM_GRACE_S = 0.25
"""Once the pairs formed serve every routed expert, how long the others' formations still get: a live FFN node
forms in tens of milliseconds; one that hangs never answers."""


def form_pairs(
    plane: DataPlane,
    peers: list[FFNPeer],
    me: pb.NodeRef,
    deadline_s: float,
    backend,
    stop: threading.Event | None = None,
    covered: Callable[[DataPlane], bool] | None = None,
) -> list[FFNPeer]:
    """Forms `plane`'s pair with each FFN peer, all at once, trying a peer that is down or still loading again
    until `deadline_s` seconds pass, or until `stop` is set (the cluster shuts down); raises ControlError naming
    the FFN node that never formed. With `covered` (layout.routing attention, after a failure): once the pairs
    formed serve every routed expert (covered(plane)), peers still down, or still not answering FORM_GRACE_S
    later (a hung node's FormPair waits out its deadline), are left out and returned, for a background
    formation to bring back (afd.node.adoption) while the others step on."""
    backend.bind_thread()
    deadline = time.monotonic() + deadline_s
    pool = ThreadPoolExecutor(max(1, len(peers)), thread_name_prefix="afd-form")
    pending: dict[Future, FFNPeer] = {}
    down: list[tuple[FFNPeer, str]] = []
    said: set[str] = set()
    covered_at = retry_at = None

    def submit(peer: FFNPeer) -> None:
        pending[pool.submit(_one_try, peer, me, plane.rank, backend)] = peer

    for peer in peers:
        submit(peer)
    try:
        while True:
            if pending:
                done = wait(pending, timeout=0.05, return_when=FIRST_COMPLETED).done
            else:  # every peer down: until the next try
                done = set()
                (stop or threading.Event()).wait(0.05)
            for f in done:
                peer = pending.pop(f)
                link, why = f.result()  # ControlError: refused for good, or stopping
                if link is not None:
                    plane.add(peer.rank, link)
                else:
                    down.append((peer, why))
            if not pending and not down:
                return []
            now = time.monotonic()
            if covered is not None and covered(plane):
                covered_at = covered_at or now
                if not pending or now - covered_at >= FORM_GRACE_S:
                    for peer, why in down:
                        log.warning("FFN node %s is down (%s): its experts' replicas take its tokens", peer.name, why)
                    for peer in pending.values():
                        log.warning("FFN node %s does not answer: its experts' replicas take its tokens", peer.name)
                    return [peer for peer, _ in down] + list(pending.values())
            if stop is not None and stop.is_set():
                name = (down[0][0] if down else next(iter(pending.values()))).name
                raise ControlError(f"the cluster is shutting down: no pair formed with FFN node {name}")
            if down and now > deadline:
                peer, why = down[0]
                raise ControlError(f"no pair formed with FFN node {peer.name} within {deadline_s:.0f}s (last: {why})")
            if down:
                retry_at = retry_at or now + 0.3
            if down and retry_at is not None and now >= retry_at:  # not covered without them: wait, try again
                for peer, why in down:
                    if peer.name not in said:
                        log.info("waiting for FFN node %s to form a pair: %s", peer.name, why)
                        said.add(peer.name)
                    submit(peer)
                down, retry_at = [], None
    finally:
        for f in pending:  # left out, or given up on: a pair one of them forms after all is closed, never used
            f.add_done_callback(_close_late_pair)
        pool.shutdown(wait=False)


def _one_try(peer: FFNPeer, me: pb.NodeRef, my_rank: int, backend) -> tuple[PairLink | None, str | None]:
    backend.bind_thread()  # this thread forms the pair's communicators
    return try_pair(peer, me, my_rank, backend)


def _close_late_pair(f: Future) -> None:
    if f.cancelled() or f.exception() is not None:
        return
    link, _ = f.result()
    if link is not None:
        link.close(queued=False)


def try_pair(peer: FFNPeer, me: pb.NodeRef, my_rank: int, backend) -> tuple[PairLink | None, str | None]:
    """One try at the pair with `peer`: (the pair, None), or (None, why not) when the peer is down or still
    loading. Raises ControlError when the peer refuses (for good) or this node is stopping."""
    try:
        return peer.form(backend, me, my_rank), None
    except grpc.RpcError as e:
        if e.code() not in _NOT_YET:
            raise ControlError(f"FFN node {peer.name} at {peer.address} refused the pair: {e.details()}") from None
        return None, e.details() or e.code().name
    except ValueError as e:  # grpc's "Cannot invoke RPC on closed channel!": the node is stopping
        if "closed channel" not in str(e):
            raise
        raise ControlError(f"{me.name} is stopping: its channel to FFN node {peer.name} is closed") from None
    except (PeerError, RuntimeError) as e:  # RuntimeError: gloo's connect, the FFN end gave up
        return None, first_line(e)
