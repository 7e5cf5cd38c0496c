"""Bringing one node of a cluster YAML up: control server, registration, model load, the wait for
every other node, the data plane, readiness. Shared by `afd-attention` and `afd-ffn`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from afd.backend import Backend, get_backend
from afd.cluster.config import ClusterConfig, Node, check_tp_layout, process_name
from afd.cluster.fingerprint import model_fingerprint
from afd.cluster.token import cluster_token
from afd.cluster.topology import resolve_model_path
from afd.control import control_pb2 as pb
from afd.control.client import ControlClient
from afd.control.coordinator import Coordinator
from afd.control.server import ControlServer
from afd.dataplane.deadlines import role_timeout
from afd.dataplane.rendezvous import ControlStore
from afd.dataplane.transport import DataPlane
from afd.model.config import ModelConfig
from afd.model.registry import load_config

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
    store: ControlStore | None = None
    """The rendezvous store every data-plane generation forms through (rank 0's control server serves it)."""
    bind_host: str | None = None
    cluster_state: int = pb.ClusterStatus.STARTING
    generation_seen: int = 0
    """The newest data-plane generation the coordinator has announced (heartbeats carry it)."""
    ready_reported: bool = False
    """ReportReady succeeded: a restarted coordinator that this node registers with again learns it."""
    shutdown: threading.Event = field(default_factory=threading.Event)
    tp_rank: int = 0

    def join_data_plane(self, st: pb.ClusterStatus) -> DataPlane:
        a = self.assignment
        if self.store is None:
            self.store = ControlStore(
                f"{a.master_addr}:{a.master_port}", self.cfg.cluster.comm_timeout, self.cfg.cluster.tls
            )
        self.plane = DataPlane(
            self.backend,
            a.rank,
            a.world_size,
            self.store,
            st.generation,
            role_timeout(self.cfg.cluster.comm_timeout, self.node.role),
            st.formation,
            self.bind_host,
            peers=list(a.peer_ranks),
        )
        try:
            self.plane.handshake(list(a.peer_ranks), cluster_token(), st.formation)
        except BaseException:
            self.release_plane()
            raise
        return self.plane

    def reform(self, why: str) -> DataPlane:
        """After a data-plane failure: leave this generation, wait up to `cluster.rejoin_timeout` for the
        failed node's replacement, and form the next generation with it. Raises ControlError when none
        comes (or the cluster shuts down)."""
        failed = self.plane.generation if self.plane is not None else 0
        planned = self.superseded()  # a newer generation was announced: a node joined, nothing failed here
        if self.plane is not None:
            self.plane.close()  # peers blocked on this node see the failure at once, not after comm_timeout
            self.plane = None
        if planned:
            log.info("leaving data-plane generation %d for the next, a planned re-formation (%s)", failed, why)
        else:
            log.warning(
                "data plane generation %d failed (%s); waiting up to %.0fs for the node to be replaced",
                failed,
                why,
                self.cfg.cluster.rejoin_timeout,
            )
        return self.join_data_plane(self.client.await_formation(failed, self.cfg.cluster.rejoin_timeout))

    def superseded(self) -> bool:
        """A newer generation than the one this node is in has been announced: a node was replaced."""
        return self.plane is not None and self.generation_seen > self.plane.generation

    def abort_lost_peers(self, st: pb.ClusterStatus) -> None:
        """Aborts the pair of every data-plane peer that the coordinator reports lost (no heartbeat for
        `cluster.heartbeat_timeout`). On NCCL and HCCL nothing on the data plane says that a peer died, and
        a hung peer (stopped, not dead) says nothing on gloo either: a wait on it would run to its deadline
        (`comm_timeout`) while every other peer of this node waited with it. The abort ends that wait, so
        an FFN node drops a dead attention node after about heartbeat_timeout and serves the others on.
        A report from before this generation formed is not acted on: the rank it names may by now be held
        by a replacement."""
        plane = self.plane
        if plane is None or not st.lost or st.generation < plane.generation:
            return
        for name in st.lost:
            if name not in self.cfg.process_names:
                continue
            rank = self.cfg.rank(name)
            if rank in plane.peers and not plane.aborted(rank):
                log.warning("%s missed its heartbeats: aborting its pair of the data plane", name)
                plane.abort(rank, f"{name} missed its heartbeats for {self.cfg.cluster.heartbeat_timeout:g}s")

    def release_plane(self) -> None:
        if self.plane is not None:
            self.plane.close()
            self.plane = None

    def close(self, plane: bool = True) -> None:
        """plane=False when the process is about to exit from a signal: another thread may be blocked
        in a data-plane wait, and tearing the process group down under it aborts the process."""
        self.client.close()
        if plane and self.plane is not None:
            self.plane.close()
        if self.store is not None:
            self.store.close()
        if self.server is not None:
            self.server.stop()


def bring_up(
    cfg: ClusterConfig,
    name: str,
    bind_host: str,
    load_model: Callable[[NodeRuntime], None],
    on_status: Callable[[pb.ClusterStatus | None], None] | None = None,
    tp_rank: int = 0,
) -> NodeRuntime:
    """Raises ControlError (refused, timed out) or PeerError (data plane) with a message for the user.
    tp_rank > 0: one more rank of attention node `name`; it registers as `name.tpR`, on the node's device
    index + R, and serves no control port (the node's rank 0 does)."""
    node = cfg.node(name)
    proc = cfg.process(process_name(name, tp_rank))
    path = resolve_model_path(cfg.model.path)
    mcfg = load_config(path)
    check_tp_layout(cfg, mcfg.num_attention_heads)
    fp = model_fingerprint(path, cfg.model.dtype, cfg.model.dummy_weights, cfg.model.seed)
    device = proc.device  # first: a device that is not here (DeviceUnavailable) leaves no server behind
    backend = get_backend(device.split(":")[0], int(device.split(":")[1]) if ":" in device else 0)
    server = None
    if tp_rank == 0:
        coordinator = Coordinator(cfg, fp, mcfg.n_routed_experts) if cfg.coordinator.name == name else None
        server = ControlServer(
            bind_host, node.ports.control, cfg.cluster.tls, coordinator, workers=8 + 2 * len(cfg.processes)
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
        rt.join_data_plane(rt.client.await_cluster())
        rt.cluster_state = rt.client.report_ready().state
        rt.ready_reported = True
    except BaseException:
        rt.close()
        raise

    def track(st: pb.ClusterStatus | None) -> None:
        rt.cluster_state = pb.ClusterStatus.DEGRADED if st is None else st.state
        if st is not None:
            rt.generation_seen = max(rt.generation_seen, st.generation)
            rt.abort_lost_peers(st)
        if st is not None and st.state == pb.ClusterStatus.SHUTDOWN:
            rt.shutdown.set()
        if on_status is not None:
            on_status(st)

    def serving() -> tuple[int, bool]:
        plane = rt.plane
        return (plane.generation if plane is not None else rt.generation_seen), rt.ready_reported

    rt.client.start_heartbeats(track, serving)
    if server is not None:
        server.set_serving(True)
    return rt
