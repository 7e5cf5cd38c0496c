"""One attention node's death never stalls the others for longer than the control plane
takes to notice it. On NCCL and HCCL nothing on the data plane says that a peer died (the fake HCCL
models that: a dead peer's transfer never completes), so the FFN node aborts the pair of a peer the
coordinator reports lost (afd/node/runtime.py, `abort_lost_peers`), and attention-side deadlines are
longer than the FFN side's (`role_timeout`), so that the FFN node gives up on a dead peer first."""

from __future__ import annotations

import signal
import time

import pytest
from cluster_helpers import Cluster, cluster_yaml
from hf_reference import PROMPTS, hf_greedy
from sse import Ticker

from afd.config.loader import load
from afd.control import control_pb2 as pb
from afd.control.coordinator import late_after
from afd.dataplane.deadlines import role_timeout
from afd.node.runtime import NodeRuntime

NEW = 48
HEARTBEAT = {"heartbeat_interval": 0.3, "heartbeat_timeout": 2}
# comm_timeout (and the fake's HANG_S, 20 s) far above the bound: without the abort on heartbeat loss the
# survivor would stall for one of them, and the test fails
CLUSTER = {**HEARTBEAT, "comm_timeout": 30, "rejoin_timeout": 60}
SLACK_S = 1.5
"""What the bound allows beyond the verdict + one heartbeat interval + one step: the coordinator's
and the FFN node's gRPC round trips, the deadline watchdog's poll and the scheduling of four processes
on the test machine's two shared cores."""


def test_attention_deadlines_are_longer_than_the_ffn_sides():
    for comm in (1.0, 30.0, 60.0, 600.0):
        ffn, attention = role_timeout(comm, "ffn"), role_timeout(comm, "attention")
        assert ffn == comm
        assert attention >= comm + 2 and attention >= comm * 1.25


class _Link:
    def __init__(self, formed_at: float):
        self.formed_at = formed_at


class _Plane:
    """The FFN node's DataPlane as abort_lost_peers sees it: its pairs, when each formed, and the aborts."""

    def __init__(self, formed_at: dict[int, float], waiting: dict[int, float] | None = None):
        self.links, self.aborts, self.waiting = {p: _Link(t) for p, t in formed_at.items()}, [], waiting or {}

    def waiting_on(self, peer: int) -> float:
        return self.waiting.get(peer, 0.0)

    def link(self, peer: int) -> _Link | None:
        return self.links.get(peer)

    def aborted(self, peer: int) -> bool:
        return peer in [p for p, _, _ in self.aborts]

    def abort_link(self, peer: int, link: _Link, why: str) -> None:
        self.aborts.append((peer, link, why))


def _runtime(tmp_path, plane: _Plane) -> NodeRuntime:
    cfg = load(str(cluster_yaml(tmp_path, "unused", 2, 1, cluster=HEARTBEAT)))
    fields = dict.fromkeys(("model_path", "model_cfg", "backend", "server", "client"))
    return NodeRuntime(cfg, cfg.node("ffn0"), plane=plane, **fields)  # type: ignore[arg-type]


def test_a_lost_peer_has_its_pair_aborted_once_and_only_if_the_report_is_newer_than_the_pair(tmp_path):
    plane = _Plane({0: 10.0, 1: 20.0})  # attn0's pair formed at 10 s, attn1's (a replacement's) at 20 s
    rt = _runtime(tmp_path, plane)
    rt.abort_lost_peers(pb.ClusterStatus(lost=["attn1"]), asked=15.0)
    assert plane.aborts == [], "a report asked for before the pair formed names a rank a replacement may hold"
    rt.abort_lost_peers(pb.ClusterStatus(lost=["ffn0", "attn1", "nobody"]), asked=21.0)
    rt.abort_lost_peers(pb.ClusterStatus(lost=["attn1"]), asked=22.0)
    assert plane.aborts == [(1, plane.links[1], "attn1 missed its heartbeats for 2s")], (
        "itself is no peer; each pair once"
    )
    rt.abort_lost_peers(pb.ClusterStatus(lost=["attn0"]), asked=15.0)
    assert [(p, link) for p, link, _ in plane.aborts] == [(1, plane.links[1]), (0, plane.links[0])]
    rt.plane = None
    rt.abort_lost_peers(pb.ClusterStatus(lost=["attn0", "attn1"]), asked=30.0)  # no plane (yet, or any more)
    del plane.links[0]
    rt.plane = plane
    rt.abort_lost_peers(pb.ClusterStatus(lost=["attn0"]), asked=30.0)  # a peer with no pair now (dropped)
    assert len(plane.aborts) == 2


def test_a_late_peer_is_dropped_only_where_this_node_has_waited_on_it_as_long(tmp_path):
    """`late` (three heartbeat intervals of silence: 0.9 s here) drops a peer this node has been
    waiting on for as long (a hang), never one it does not wait on (a peer busy elsewhere, or merely slow to
    heartbeat)."""
    plane = _Plane({0: 10.0, 1: 10.0}, waiting={0: 0.2, 1: 1.0})
    rt = _runtime(tmp_path, plane)
    rt.abort_lost_peers(pb.ClusterStatus(late=["attn0", "attn1"]), asked=20.0)
    assert [(p, why) for p, _, why in plane.aborts] == [
        (1, "attn1 is silent for 0.9s of heartbeats while this node waited 1.0s on it")
    ]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return {tuple(p): ids for p, (ids, _) in zip(PROMPTS, hf_greedy(tiny_checkpoint, PROMPTS, NEW))}


@pytest.mark.slow  # three node processes on the fake NPU and a kill: about 30 s; `make test-slow`, which CI runs
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "sig,plane",
    [(signal.SIGKILL, "hccl"), (signal.SIGSTOP, "hccl"), (signal.SIGSTOP, "gloo")],
    ids=["kill-9", "stopped", "stopped-gloo"],
)
def test_a_dead_attention_node_stalls_the_other_no_longer_than_its_late_verdict(
    tiny_checkpoint, reference, tmp_path, sig, plane
):
    """The acceptance check at 2A1F on the fake HCCL: while attn0 streams, attn1 (itself mid-decode) is
    killed with SIGKILL, or stopped (alive, its sockets open: a hang, not a death); attn0's longest pause
    between two streamed chunks is at most the verdict on attn1 (late: three heartbeat intervals of silence,
    while the FFN node waited on it as long) + one heartbeat interval (the FFN node learns of it
    at its next heartbeat) + one step (the longest seen before) + SLACK_S, and every completion equals HF's
    tokens. On gloo too, which cannot abort a blocked wait: the pair's connections are shut down instead
    (afd/backend/gloo_pairs.py)."""
    from npu_fake import fake_env, on_devices

    path = cluster_yaml(tmp_path, tiny_checkpoint, 2, 1, name="hb-abort", cluster=CLUSTER)
    env = None
    if plane == "hccl":
        on_devices(path)
        env = fake_env(tmp_path / "fake-npu")
    with Cluster(path, env=env) as c:
        c.start_all()
        c.wait_ready()
        busy = [
            Ticker(c.url("attn1"), PROMPTS, NEW) for _ in range(2)
        ]  # the FFN node is mid-step with attn1 when it dies
        ticker = Ticker(c.url("attn0"), PROMPTS, NEW)
        try:
            end = time.monotonic() + 60
            while len(ticker.done) < 2 or not all(b.chunks for b in busy):  # past every prompt's first prefill
                assert time.monotonic() < end and not ticker.errors, ticker.errors
                time.sleep(0.1)
            killed = time.monotonic()
            c.procs["attn1"].send_signal(sig)
            end = killed + 20
            while time.monotonic() < end and not (ticker.chunks and ticker.chunks[-1] > killed + 8):
                time.sleep(0.2)  # 8 s of tokens after the kill: past the bound, well short of comm_timeout
        finally:
            ticker.join()
            c.procs["attn1"].kill()  # a stopped process too
            for b in busy:
                b.join()
        log = c.log("ffn0")
        assert not ticker.errors, ticker.errors
        assert "attn1 is silent for" in log and "attention rank 1 (attn1) dropped" in log, log[-3000:]
        step = max(ticker.gaps(0, killed))
        stall = max(ticker.gaps(killed, float("inf")))
        late = late_after(CLUSTER["heartbeat_interval"], CLUSTER["heartbeat_timeout"])
        bound = late + CLUSTER["heartbeat_interval"] + step + SLACK_S
        assert ticker.chunks[-1] > killed + 8, "attn0 stopped streaming after the kill"
        assert stall <= bound, f"attn0 stalled {stall:.2f}s; bound {bound:.2f}s (one step: {step:.2f}s)"
        assert c.procs["attn0"].poll() is None and c.procs["ffn0"].poll() is None
    for prompt, ids in ticker.done:
        assert ids == reference[tuple(prompt)]
