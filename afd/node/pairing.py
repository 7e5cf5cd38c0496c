"""An attention rank forming its pairs of the data plane, one FFN node at a time, through that FFN node's
`Pairs` service (ffn_node/pairs.py) and rendezvous store: at start-up and after a failure of its own,
while every other pair of the cluster keeps stepping (docs/architecture/dataplane.md, "Pairs")."""

from __future__ import annotations

import logging
import secrets
import threading
import time

import grpc

from afd.cluster.config import ClusterConfig
from afd.cluster.token import cluster_token
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
        self.stub.FormPair(req, metadata=call_metadata(), timeout=10)
        link = PairLink(backend, self.store, key, ATTENTION, self.timeout_s)
        try:
            handshake(link, cluster_token(), self.timeout_s)
        except BaseException:
            link.close(queued=True)
            raise
        return link

    def close(self) -> None:
        self.store.close()
        self._channel.close()


def form_pairs(
    plane: DataPlane,
    peers: list[FFNPeer],
    me: pb.NodeRef,
    deadline_s: float,
    backend,
    stop: threading.Event | None = None,
) -> None:
    """Forms `plane`'s pair with each FFN peer, trying a peer that is down or still loading again until
    `deadline_s` seconds pass, or until `stop` is set (the cluster shuts down); raises ControlError naming
    the FFN node that never formed."""
    backend.bind_thread()
    deadline = time.monotonic() + deadline_s
    for peer in peers:
        said = False
        while True:
            try:
                plane.add(peer.rank, peer.form(backend, me, plane.rank))
                break
            except grpc.RpcError as e:
                if e.code() not in _NOT_YET:
                    refused = f"FFN node {peer.name} at {peer.address} refused the pair: {e.details()}"
                    raise ControlError(refused) from None
                why = e.details() or e.code().name
            except ValueError as e:  # grpc's "Cannot invoke RPC on closed channel!": the node is stopping
                if "closed channel" not in str(e):
                    raise
                raise ControlError(f"{me.name} is stopping: its channel to FFN node {peer.name} is closed") from None
            except (PeerError, RuntimeError) as e:  # RuntimeError: gloo's connect, the FFN end gave up
                why = first_line(e)
            if time.monotonic() > deadline:
                raise ControlError(
                    f"no pair formed with FFN node {peer.name} within {deadline_s:.0f}s (last: {why})"
                ) from None
            if not said:
                log.info("waiting for FFN node %s to form a pair: %s", peer.name, why)
                said = True
            if stop is not None and stop.wait(0.3):
                raise ControlError(f"the cluster is shutting down: no pair formed with FFN node {peer.name}")
            if stop is None:
                time.sleep(0.3)
