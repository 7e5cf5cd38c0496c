"""The FFN node's `Pairs` service: an attention rank asks for a pair, this node forms its end on a thread of
its own and hands the formed pair to the serving loop (ffn_node/server.py), which adopts it at its next
step boundary. The loop never stops for a formation, so the other attention nodes keep stepping while a
replaced or failed one forms its pairs (docs/architecture/dataplane.md, "Pairs").

An attention node's TP ranks step in lockstep, driven by rank 0 (afd.engine.runner.follow), so their pairs
are handed over together, once every rank of the node has formed one: a loop that served one rank of a
node without the others would wait for a header that rank 0 sends only after that step."""

from __future__ import annotations

import logging
import queue
import threading

import grpc

from afd.backend import Backend
from afd.cluster.token import cluster_token
from afd.config.schema import ClusterConfig
from afd.control import control_pb2 as pb
from afd.control import control_pb2_grpc as pb_grpc
from afd.control.kvstore import KeyValues
from afd.dataplane.pairs import FFN, PairLink, first_line, handshake
from afd.dataplane.rendezvous import ControlStore
from afd.dataplane.transport import DataPlane, PeerError
from ffn_node.peers import FormedPair

log = logging.getLogger("afd.ffn")
MAX_FORM_S = 120.0
"""The longest a formation may wait for its attention end (a request's timeout_seconds is capped here)."""


class PairAcceptor(pb_grpc.PairsServicer):
    def __init__(self, cfg: ClusterConfig, name: str):
        self.cfg, self.name = cfg, name
        self.backend: Backend | None = None
        self.rank = cfg.rank(name)
        self.attention = {p.name: r for r, p in enumerate(cfg.processes) if p.node.role == "attention"}
        self.node_of = {p.name: p.node.name for p in cfg.processes if p.node.role == "attention"}
        self.formed: queue.SimpleQueue = queue.SimpleQueue()
        """Lists of (attention rank, name, PairLink), every TP rank of one attention node: for the loop to adopt."""
        self._forming: dict[str, dict[int, FormedPair]] = {}
        """Per attention node, its ranks' pairs formed so far (the node's list goes once it is complete)."""
        self.plane: DataPlane | None = None
        """Set once the node is loaded: requests before then are answered UNAVAILABLE (tried again)."""
        self._asked: dict[int, str] = {}
        """Per attention rank, the key of its latest request: a pair under an older key is stale (that end is gone)."""
        self._mu = threading.Lock()
        self._store: ControlStore | None = None
        self._kv: KeyValues | None = None
        self.experts: tuple[int, ...] = ()
        """The routed experts this node holds (set once loaded): each pair's reply names them, so that an
        attention rank routes to what the node really holds (a node restarted with a new layout.placement)."""

    def accept(self, plane: DataPlane, kv: KeyValues) -> None:
        """The node is loaded and its plane made: pairs form from here on. kv: this node's store, whose
        keys of each formation are dropped once it ended (formed or not)."""
        self.backend, self._kv = plane.backend, kv
        node = self.cfg.node(self.name)
        # this node's own Rendezvous service, as the attention ends reach it
        self._store = ControlStore(f"{node.host}:{node.ports.control}", MAX_FORM_S, self.cfg.cluster.tls)
        self.plane = plane

    def FormPair(self, req: pb.PairRequest, context) -> pb.PairReply:
        plane = self.plane
        if plane is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"FFN node {self.name} is still loading")
        assert plane is not None  # context.abort raises
        if self.attention.get(req.name) != req.rank or not req.key:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"FFN node {self.name}: {req.name!r} is not an attention rank of this cluster at data-plane rank "
                f"{req.rank} (the cluster YAML's attention ranks: {', '.join(self.attention)})",
            )
        # the rank's end of every older pair is gone: the loop's wait on the one in use ends at once (NCCL, HCCL;
        # on gloo its sockets close anyway)
        with self._mu:
            self._asked[req.rank] = req.key
        plane.abort(req.rank, f"{req.name} forms a new pair")
        timeout = min(max(req.timeout_seconds, 1.0), MAX_FORM_S)
        threading.Thread(
            target=self._form, args=(req.name, req.rank, req.key, timeout), name="afd-form-pair", daemon=True
        ).start()
        return pb.PairReply(rank=self.rank, experts=self.experts)

    def _accepted(self) -> tuple[Backend, ControlStore, KeyValues]:
        """What accept() set, before the plane: FormPair starts a formation only once the plane is set."""
        assert self.backend is not None and self._store is not None and self._kv is not None  # set by accept()
        return self.backend, self._store, self._kv

    def _form(self, name: str, rank: int, key: str, timeout_s: float) -> None:
        backend, store, kv = self._accepted()
        backend.bind_thread()
        try:
            link = self._formed(backend, store, name, key, timeout_s)
        finally:  # both ends are past the store (the handshake needs both), or the formation failed
            kv.drop_prefix(f"afd/pair/{key}/")
        if link is None:
            return
        self._hold([FormedPair(rank, name, link)])

    def _hold(self, formed: list[FormedPair]) -> None:
        """Holds formed pairs until every rank of their attention node has one, then hands the node's over."""
        node = self.node_of[formed[0].name]
        with self._mu:
            forming = self._forming.setdefault(node, {})
            older = [forming[p.rank].link for p in formed if p.rank in forming]
            forming.update({p.rank: p for p in formed})
            done = len(forming) == self.cfg.layout.attention_tp
            if done:
                del self._forming[node]
        for link in older:  # the rank asked again before its node's other ranks formed theirs
            link.close(queued=True)
        if done:
            self.formed.put([forming[r] for r in sorted(forming)])

    def current(self, group: list[FormedPair]) -> bool:
        """At adoption (the serving loop): True when every pair of the node's group is its rank's latest.
        Otherwise a rank asked again meanwhile (its end of the older pair is gone): the stale pairs are
        closed, and the others are held again until the rank's new pair completes the node's group."""
        with self._mu:
            stale = [p for p in group if self._asked.get(p.rank) != p.link.key]
        if not stale:
            return True
        for p in stale:
            log.info("pair with %s superseded before it was taken into use", p.name)
            p.link.close(queued=True)
        rest = [x for x in group if x not in stale]
        if rest:
            self._hold(rest)
        return False

    def _formed(self, backend: Backend, store: ControlStore, name: str, key: str, timeout_s: float) -> PairLink | None:
        try:
            link = PairLink(backend, store, key, FFN, timeout_s)
        except Exception as e:  # noqa: BLE001 (the attention end gave up, or died: it asks again)
            log.warning("pair with %s did not form: %s", name, first_line(e))
            return None
        try:
            handshake(link, cluster_token(), timeout_s)
        except PeerError as e:
            log.warning("pair with %s refused: %s", name, e)
            link.close(queued=True)
            return None
        return link
