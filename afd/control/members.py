"""What the coordinator keeps per registered node, and what it tells a node when it registers."""

from __future__ import annotations

from dataclasses import dataclass

from afd.config.schema import ClusterConfig
from afd.control import control_pb2 as pb


@dataclass
class Member:
    """What the coordinator knows of a registered node process (soft: a restarted coordinator learns it again)."""

    name: str
    role: str
    address: str
    instance_id: str
    fingerprint: str
    last_seen: float
    ready: bool = False
    paused: str = ""
    """Why its requests are paused, as its last heartbeat said (empty: serving)."""


def assignment(cfg: ClusterConfig, proc, n_routed: int) -> pb.RegisterReply:
    """A process's rank, and its data-plane peers: an attention rank's are the FFN nodes, an FFN
    node's every attention node's every TP rank."""
    node = proc.node
    peers = [p.name for p in cfg.processes if p.node.role != node.role]
    reply = pb.RegisterReply(
        rank=cfg.rank(proc.name),
        world_size=len(cfg.processes),
        peer_ranks=[cfg.rank(p) for p in peers],
        cluster_name=cfg.cluster.name,
    )
    return reply  # an FFN node's experts: the YAML's placement, which it reads (afd.config.placement)
