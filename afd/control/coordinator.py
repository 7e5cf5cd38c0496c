"""The coordinator: checks the cluster in front of it against the YAML, hands out ranks, tracks liveness.

Its state is soft: a restarted coordinator learns the running nodes again from their registrations
(`RegisterRequest.again`, sent by a node that its heartbeat found unknown), so the coordinator's node
can be replaced like any other.

It runs inside the node named by `cluster.coordinator` (default: the first attention node), on that
node's control port. All state is guarded by one condition variable; AwaitCluster blocks on it.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from afd import __version__
from afd.config.loader import check_expert_layout
from afd.config.schema import ClusterConfig
from afd.control import control_pb2 as pb
from afd.control import control_pb2_grpc as pb_grpc
from afd.control.members import Member, assignment

log = logging.getLogger("afd.coordinator")
LATE_HEARTBEATS = 3
"""Heartbeat intervals of silence after which a member is late (ClusterStatus.late)."""


def late_after(interval: float, timeout: float) -> float:
    """Seconds of silence that make a member late: LATE_HEARTBEATS intervals, short of the timeout."""
    return min(LATE_HEARTBEATS * interval, timeout)


State = pb.ClusterStatus


class Coordinator(pb_grpc.CoordinatorServicer):
    def __init__(self, cfg: ClusterConfig, fingerprint: str, n_routed: int):
        check_expert_layout(cfg, n_routed)
        self.cfg, self.fingerprint, self.n_routed = cfg, fingerprint, n_routed
        self.members: dict[str, Member] = {}
        self.state = State.STARTING
        self.message = ""
        self.draining: set[str] = set()
        self.restarting: set[str] = set()
        """FFN nodes told to exit for their supervisor to start them again (Restart); a new instance of one
        registers at once, without waiting for the old one to miss its heartbeats."""
        self.resumed = False
        """Running nodes registered again (this coordinator restarted under a serving cluster): until every
        node is ready it reports DEGRADED, not STARTING, so that they keep taking requests."""
        self._cv = threading.Condition()
        self._started = time.monotonic()

    # ---- helpers ---------------------------------------------------------------------------------

    def _lost(self) -> list[str]:
        limit = time.monotonic() - self.cfg.cluster.heartbeat_timeout
        return sorted(m.name for m in self.members.values() if m.last_seen < limit)

    def _late(self) -> list[str]:
        """Members silent for LATE_HEARTBEATS intervals but not yet lost: a peer that has waited as long on one
        of them judges it hung (afd.node.runtime, abort_lost_peers), long before heartbeat_timeout."""
        now, c = time.monotonic(), self.cfg.cluster
        late, lost = now - late_after(c.heartbeat_interval, c.heartbeat_timeout), now - c.heartbeat_timeout
        return sorted(m.name for m in self.members.values() if lost <= m.last_seen < late)

    def _status(self) -> pb.ClusterStatus:
        lost = self._lost()
        state = self.state
        paused = [f"{m.name}: requests paused: {m.paused}" for _, m in sorted(self.members.items()) if m.paused]
        if (state == State.READY and (lost or paused)) or (state == State.STARTING and self.resumed):
            state = State.DEGRADED
        return pb.ClusterStatus(
            state=state,
            missing=[n for n in self.cfg.process_names if n not in self.members],
            registered=sorted(self.members),
            ready=sorted(m.name for m in self.members.values() if m.ready),
            lost=lost,
            late=self._late(),
            message="; ".join([self.message] * bool(self.message) + paused),
            draining=sorted(self.draining),
            restarting=sorted(self.restarting),
        )

    def _member(self, ref: pb.NodeRef, context) -> Member:
        m = self.members.get(ref.name)
        if m is None or m.instance_id != ref.instance_id:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"node {ref.name!r} is not registered with this coordinator (it restarted, or another "
                "instance took the name)",
            )
        assert m is not None  # context.abort raised
        m.last_seen = time.monotonic()
        return m

    def _wait(self, done, deadline: float, context, on_wake=None) -> None:
        """Waits on the condition (held) until done(), the deadline or the call's own deadline."""
        while not done():
            left = deadline - time.monotonic()
            if context.time_remaining() is not None:
                left = min(left, context.time_remaining())
            if left <= 0:
                return
            self._cv.wait(min(left, 0.5))
            if on_wake is not None:
                on_wake()

    # ---- RPCs ------------------------------------------------------------------------------------

    def Register(self, req: pb.RegisterRequest, context) -> pb.RegisterReply:
        with self._cv:
            if req.name not in self.cfg.process_names:
                context.abort(
                    grpc.StatusCode.NOT_FOUND,
                    f"unknown node {req.name!r}: the cluster YAML names {', '.join(self.cfg.process_names)}",
                )
            proc = self.cfg.process(req.name)
            node = proc.node
            if req.role != node.role:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"node {req.name!r} registered as {req.role!r} but the YAML says {node.role!r}",
                )
            old = self.members.get(req.name)
            replacing = old is not None and old.instance_id != req.instance_id
            if replacing and old is not None and req.name not in self._lost() and req.name not in self.restarting:
                context.abort(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"duplicate node name {req.name!r}: already registered from {old.address} "
                    "(a replacement is taken once that instance misses its heartbeats)",
                )
            if req.model_fingerprint != self.fingerprint:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"node {req.name!r} has model fingerprint {req.model_fingerprint[:12]} but the "
                    f"cluster serves {self.fingerprint[:12]}: a different model, dtype or weights",
                )
            if req.version != __version__:
                log.warning("node %s runs afd %s, the coordinator %s", req.name, req.version, __version__)
            if replacing:  # the old instance is gone; the new one forms its own pairs of the data plane
                self.draining.discard(req.name)
                self.restarting.discard(req.name)
                log.warning("%s replaced by a new instance from %s", req.name, req.address)
            member = Member(req.name, req.role, req.address, req.instance_id, req.model_fingerprint, time.monotonic())
            if req.again:  # a running node this coordinator does not know: it restarted (its state is soft)
                member.ready = req.ready
                self.resumed = self.resumed or req.ready
            self.members[req.name] = member
            log.info(
                "registered %s (%s) from %s%s [%d/%d]",
                req.name,
                req.role,
                req.address,
                " again, serving" if req.again else "",
                len(self.members),
                len(self.cfg.processes),
            )
            self._maybe_ready()
            self._cv.notify_all()
            return assignment(self.cfg, proc, self.n_routed)

    def _maybe_ready(self) -> None:
        if (
            self.state == State.STARTING
            and len(self.members) == len(self.cfg.processes)
            and all(m.ready for m in self.members.values())
        ):
            self.state = State.READY
            log.info("cluster %s ready: %s", self.cfg.cluster.name, self.cfg.topology_name)

    def AwaitCluster(self, ref: pb.NodeRef, context) -> pb.ClusterStatus:
        deadline = self._started + self.cfg.cluster.startup_timeout
        with self._cv:
            self._member(ref, context)
            self._wait(
                lambda: len(self.members) == len(self.cfg.processes) or self.state != State.STARTING,
                deadline,
                context,
                on_wake=lambda: self._member(ref, context),  # waiting counts as alive
            )
            missing = [n for n in self.cfg.process_names if n not in self.members]
            if missing and time.monotonic() >= deadline and self.state == State.STARTING:
                self.state = State.FAILED
                self.message = (
                    f"startup timeout ({self.cfg.cluster.startup_timeout:.0f}s): nodes never "
                    f"registered: {', '.join(missing)}"
                )
                log.error("%s", self.message)
                self._cv.notify_all()
            return self._status()

    def ReportReady(self, ref: pb.NodeRef, context) -> pb.ClusterStatus:
        with self._cv:
            self._member(ref, context).ready = True
            self._maybe_ready()
            self._cv.notify_all()
            return self._status()

    def Heartbeat(self, ref: pb.NodeRef, context) -> pb.ClusterStatus:
        with self._cv:
            self._member(ref, context).paused = ref.paused
            return self._status()

    def Drain(self, req: pb.DrainRequest, context) -> pb.ClusterStatus:
        """Attention nodes told to drain take no new requests and finish their running ones (they see
        it in their next heartbeat); one node (`req.node`) or every attention node."""
        attention = [n.name for n in self.cfg.attention_nodes]
        if req.node and req.node not in attention:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{req.node!r} is not an attention node of this cluster ({', '.join(attention)})",
            )
        with self._cv:
            if req.node:
                self.draining.add(req.node)
                log.info("draining %s", req.node)
            else:
                self.draining.update(attention)
                if self.state in (State.STARTING, State.READY, State.DEGRADED):
                    self.state = State.DRAINING
                    self.message = "draining"
            return self._status()

    def Restart(self, req: pb.DrainRequest, context) -> pb.ClusterStatus:
        """FFN node `req.node` exits when it sees this in its next heartbeat, for its supervisor (afd launch,
        afd serve, Kubernetes) to start it again with the YAML as it is now: how `afd rebalance --apply` has
        each FFN node load its new layout.placement."""
        ffn = [n.name for n in self.cfg.ffn_nodes]
        if req.node not in ffn:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{req.node!r} is not an FFN node of this cluster ({', '.join(ffn) or 'none'})",
            )
        with self._cv:
            self.restarting.add(req.node)
            log.info("%s asked to restart", req.node)
            return self._status()

    def Shutdown(self, req: pb.ShutdownRequest, context) -> pb.ClusterStatus:
        with self._cv:
            self.state = State.SHUTDOWN
            self.message = req.reason or "shutdown requested"
            log.info("shutdown: %s", self.message)
            self._cv.notify_all()
            return self._status()

    def GetStatus(self, req: pb.StatusRequest, context) -> pb.ClusterStatus:
        with self._cv:
            return self._status()
