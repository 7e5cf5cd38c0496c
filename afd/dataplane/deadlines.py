"""The data plane's deadlines: how long each role waits on a peer, and the error a passed one raises (the
watchdog that holds them is afd.backend.deadlines)."""

from __future__ import annotations

from afd.backend.base import PeerError


def role_timeout(comm_timeout: float, role: str) -> float:
    """The data plane's deadline on a node of `role`: `comm_timeout` on an FFN node, and longer on an
    attention node, by max(2 s, comm_timeout / 4).

    When one attention node dies, the FFN node waits on it and every other attention node waits on the
    FFN node, with deadlines that start at about the same time. The FFN node must give up first: it then
    drops the dead peer alone and answers the others, whose waits end normally. Were an attention
    node's deadline to pass first, it would leave the data plane and make every node re-form (a pause
    for everyone, and on NCCL/HCCL a teardown with work queued). The margin covers what happens
    between the FFN's deadline and the others' reply: the watchdog's poll, the abort, the rest of the
    layer and the transfer back, and on stream-ordered backends the head start of a host that runs ahead
    of its device and so starts its deadlines early, which grows with the step, hence with the
    comm_timeout a cluster with long steps sets."""
    return comm_timeout + max(2.0, comm_timeout / 4) if role == "attention" else comm_timeout


def plane_error(what: str, peer: int, timeout_s: float) -> PeerError:
    return PeerError(f"data plane: {what} with rank {peer} timed out after {timeout_s:.0f}s", peer)
