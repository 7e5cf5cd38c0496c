"""Bringing one node of a cluster YAML up: control server, registration, model load, the wait for
every other node, an attention node's TP world and its pairs of the data plane, readiness. Shared by
`afd-attention` and `afd-ffn`."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from afd.backend import Backend, get_backend
from afd.cluster.fingerprint import model_fingerprint
from afd.cluster.topology import model_dir
from afd.config.loader import check_routing, check_tp_layout
from afd.config.schema import ClusterConfig, Node, process_name
from afd.control import control_pb2 as pb
from afd.control.client import ControlClient
from afd.control.coordinator import Coordinator, late_after
from afd.control.server import ControlServer
from afd.dataplane.deadlines import role_timeout
from afd.dataplane.rendezvous import bind_gloo
from afd.dataplane.transport import DataPlane
from afd.model.config import ModelConfig
from afd.model.registry import load_config
from afd.node.pairing import FFNPeer, form_pairs
from afd.node.tp_world import TPWorld

log = logging.getLogger("afd.node")


@dataclass
class NodeRuntime:
    cfg: ClusterConfig
    node: Node
    model_path: str
    model_cfg: ModelConfig
    backend: Backend
    server: ControlServer | None
    """None on an attention node's TP ranks > 0: they listen on nothing of their own."""
    client: ControlClient
    assignment: pb.RegisterReply | None = None
    plane: DataPlane | None = None
    ffn_peers: list[FFNPeer] = field(default_factory=list)
    """An attention rank's FFN nodes, as it forms pairs with them."""
    left_out: list[FFNPeer] = field(default_factory=list)
    """FFN nodes the last formation left out (down, their experts held by others): afd.node.adoption."""
    tp_world: TPWorld | None = None
    """An attention node's TP ranks' own torch.distributed world (attention_tp > 1)."""
    bind_host: str | None = None
    cluster_state: int = pb.ClusterStatus.STARTING
    ready_reported: bool = False
    """ReportReady succeeded: a restarted coordinator that this node registers with again learns it."""
    shutdown: threading.Event = field(default_factory=threading.Event)
    tp_rank: int = 0
    paused: Callable[[], str] = lambda: ""
    """Why this node's requests are paused ("" while serving), sent in each heartbeat: a serving attention node
    sets it to its engine's (afd.engine.engine Engine.paused)."""

    def make_plane(self) -> DataPlane:
        a = self.assignment
        assert a is not None, "registered first (bring_up)"
        bind_gloo(self.bind_host)  # gloo's pair listeners on the node's own address
        self.plane = DataPlane(self.backend, a.rank, role_timeout(self.cfg.cluster.comm_timeout, self.node.role))
        return self.plane

    def form_pairs(self, deadline_s: float, covered=None) -> DataPlane:
        """An attention rank's pair with every FFN node (none in a cluster without FFN nodes). With
        `covered` (afd.node.pairing.form_pairs), FFN nodes that are down may be left out: `left_out`."""
        plane, t0 = self.plane or self.make_plane(), time.monotonic()
        if not self.ffn_peers:
            timeout = role_timeout(self.cfg.cluster.comm_timeout, self.node.role)
            assert self.assignment is not None, "registered first (bring_up)"
            self.ffn_peers = [FFNPeer(self.cfg, r, timeout) for r in self.assignment.peer_ranks]
        self.left_out = form_pairs(
            plane, self.ffn_peers, self.client.ref, deadline_s, self.backend, self.shutdown, covered
        )
        log.info(
            "data plane up: rank %d, %d pair(s) over %s, in %.2fs%s",
            plane.rank,
            len(plane.peers),
            self.backend.dist_backend,
            time.monotonic() - t0,
            f"; left out (down): {', '.join(p.name for p in self.left_out)}" if self.left_out else "",
        )
        return plane

    def reform(self, why: str, covered=None) -> DataPlane:
        """After a failure of this rank's data plane: ends its pairs (its FFN peers drop it) and forms new
        ones, waiting up to `cluster.rejoin_timeout` for an FFN node that is down to be replaced (with
        `covered`, not when the others hold every expert: afd.node.pairing.form_pairs). No other node takes
        part. Raises ControlError when an FFN node stays away."""
        if self.plane is not None:
            self.plane.close()  # peers blocked on this rank see the failure at once, not after comm_timeout
            self.plane = None
        log.warning(
            "data plane failed (%s); forming this rank's pairs again, waiting up to %.0fs for its FFN node(s)",
            why,
            self.cfg.cluster.rejoin_timeout,
        )
        return self.form_pairs(self.cfg.cluster.rejoin_timeout, covered)

    def abort_lost_peers(self, st: pb.ClusterStatus, asked: float) -> None:
        """Aborts the pair of every data-plane peer that the coordinator reports lost (no heartbeat for
        `cluster.heartbeat_timeout`). On NCCL and HCCL nothing on the data plane says that a peer died, and
        a hung peer (stopped, not dead) says nothing on gloo either: a wait on it would run to its deadline
        (`comm_timeout`) while every other peer of this node waited with it. The abort ends that wait, so
        an FFN node drops a dead attention node after about heartbeat_timeout and serves the others on.
        A peer reported late (silent for LATE_HEARTBEATS intervals) is judged sooner, where this node has
        waited on it as long: a hang costs the others about that, not heartbeat_timeout; a busy peer, which
        still heartbeats, is never late. A report asked for before the pair formed is not acted on: its peer
        may be a replacement by now."""
        plane = self.plane
        if plane is None or not (st.lost or st.late):
            return
        c = self.cfg.cluster
        late_s = late_after(c.heartbeat_interval, c.heartbeat_timeout)
        for name in [*st.lost, *st.late]:
            if name not in self.cfg.process_names:
                continue
            rank = self.cfg.rank(name)
            link = plane.link(rank)
            if link is None or plane.aborted(rank) or link.formed_at > asked:
                continue
            if name in st.lost:
                why = f"{name} missed its heartbeats for {c.heartbeat_timeout:g}s"
            else:  # a suspect: only where this node has waited on it as long (a hung peer, not a busy one)
                waited = plane.waiting_on(rank)
                if waited < late_s:
                    continue
                why = f"{name} is silent for {late_s:g}s of heartbeats while this node waited {waited:.1f}s on it"
            log.warning("%s: aborting its pair of the data plane", why)
            plane.abort_link(rank, link, why)

    def release_plane(self) -> None:
        if self.plane is not None:
            self.plane.close()
            self.plane = None

    def close(self, plane: bool = True) -> None:
        """plane=False when the process is about to exit from a signal: another thread may be blocked
        in a data-plane wait, and tearing a pair down under it aborts the process."""
        self.client.close()
        if plane and self.plane is not None:
            self.plane.close()
        for peer in self.ffn_peers:
            peer.close()
        if self.tp_world is not None and plane:
            self.tp_world.close()
        if self.server is not None:
            self.server.stop()


def bring_up(
    cfg: ClusterConfig,
    name: str,
    bind_host: str,
    load_model: Callable[[NodeRuntime], None],
    on_status: Callable[[pb.ClusterStatus | None], None] | None = None,
    tp_rank: int = 0,
    pairs=None,
) -> NodeRuntime:
    """Raises ControlError (refused, timed out) or PeerError (data plane) with a message for the user.
    tp_rank > 0: one more rank of attention node `name`; it registers as `name.tpR`, on the node's device
    index + R, and serves no control port (the node's rank 0 does). pairs: an FFN node's Pairs service
    (ffn_node/pairs.PairAcceptor), which starts accepting once the node is loaded."""
    node = cfg.node(name)
    proc = cfg.process(process_name(name, tp_rank))
    path = model_dir(cfg)
    mcfg = load_config(path)
    check_tp_layout(cfg, mcfg.num_attention_heads)
    check_routing(cfg, mcfg)
    fp = model_fingerprint(path, cfg.model.dtype, cfg.model.dummy_weights, cfg.model.seed)
    device = proc.device  # first: a device that is not here (DeviceUnavailable) leaves no server behind
    backend = get_backend(device.split(":")[0], int(device.split(":")[1]) if ":" in device else 0)
    if cfg.shares_device(name):
        share = backend.shared_device_env(f"{cfg.cluster.name}-{node.host}-{name}")
        if share is None:
            raise ValueError(f"{name}: shares {device} with another node, which the {device} backend cannot do")
        os.environ.update(share)
    server = None
    if tp_rank == 0:
        coordinator = Coordinator(cfg, fp, mcfg.n_routed_experts) if cfg.coordinator.name == name else None
        server = ControlServer(
            bind_host, node.ports.control, cfg.cluster.tls, coordinator, workers=8 + 2 * len(cfg.processes), pairs=pairs
        )
    rt = NodeRuntime(
        cfg,
        node,
        path,
        mcfg,
        backend,
        server,
        ControlClient(cfg, name, proc.name),
        bind_host=bind_host,
        tp_rank=tp_rank,
    )
    try:
        rt.assignment = rt.client.register(fp)
        a = rt.assignment
        log.info("registered with %s as rank %d of %d", rt.client.address, a.rank, a.world_size)
        load_model(rt)
        rt.client.await_cluster()
        if node.role == "ffn":
            assert server is not None  # an FFN node is TP rank 0
            pairs.accept(rt.make_plane(), server.kv)
            log.info("data plane up: rank %d over %s, taking pairs", a.rank, backend.dist_backend)
        else:
            if cfg.layout.attention_tp > 1:
                rt.tp_world = TPWorld.join(cfg, name, tp_rank, backend, bind_host)
            rt.form_pairs(cfg.cluster.startup_timeout)
        rt.cluster_state = rt.client.report_ready().state
        rt.ready_reported = True
    except BaseException:
        rt.close()
        raise

    def track(st: pb.ClusterStatus | None, asked: float) -> None:
        rt.cluster_state = pb.ClusterStatus.DEGRADED if st is None else st.state
        if st is not None:
            rt.abort_lost_peers(st, asked)
        if st is not None and st.state == pb.ClusterStatus.SHUTDOWN:
            rt.shutdown.set()
        if on_status is not None:
            on_status(st)

    rt.client.start_heartbeats(track, lambda: rt.ready_reported, lambda: rt.paused())
    if server is not None:
        server.set_serving(True)
    return rt
