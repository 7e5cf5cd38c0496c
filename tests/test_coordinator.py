"""The coordinator's generations, in process: when the data plane must re-form and with whom."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cluster_helpers import cluster_yaml

from afd import __version__
from afd.cluster.config import load
from afd.control import control_pb2 as pb
from afd.control.coordinator import Coordinator


class _Aborted(Exception):
    pass


class _Context:
    """What a servicer sees of a gRPC call: a deadline and abort."""

    def __init__(self, seconds: float | None = None):
        self._end = None if seconds is None else time.monotonic() + seconds

    def time_remaining(self):
        return None if self._end is None else max(0.0, self._end - time.monotonic())

    def abort(self, code: grpc.StatusCode, details: str):
        raise _Aborted(f"{code.name}: {details}")


@pytest.fixture
def coordinator(tmp_path):
    cfg = load(str(cluster_yaml(tmp_path, str(tmp_path), 2, 1, cluster={"heartbeat_timeout": 0.3})))
    c = Coordinator(cfg, "fp", n_routed=4)
    for name, role in NODES:
        c.Register(_register(name, role, "i0"), _Context())
    for name, _ in NODES:  # the first formation
        assert c.AwaitCluster(_ref(name), _Context(5)).generation == 0
    for name, _ in NODES:
        c.ReportReady(_ref(name), _Context())
    return c


NODES = (("attn0", "attention"), ("attn1", "attention"), ("ffn0", "ffn"))


def _ref(name: str, instance: str = "i0") -> pb.NodeRef:
    return pb.NodeRef(name=name, instance_id=instance)


def _register(name: str, role: str, instance: str) -> pb.RegisterRequest:
    return pb.RegisterRequest(
        name=name, role=role, address="127.0.0.1", instance_id=instance, model_fingerprint="fp", version=__version__
    )


def _await(c: Coordinator, ref: pb.NodeRef, after: int, seconds: float = 3) -> pb.ClusterStatus:
    return c.AwaitFormation(pb.FormationRequest(ref=ref, after=after, timeout_seconds=seconds), _Context(10))


def test_a_replacement_opens_a_generation_that_forms_once_everyone_asks(coordinator):
    c = coordinator
    with pytest.raises(_Aborted, match="ALREADY_EXISTS: duplicate node name 'attn1'"):
        c.Register(_register("attn1", "attention", "i1"), _Context())  # the old instance is alive
    assert c.generation == 0
    time.sleep(0.4)  # attn1's old instance misses its heartbeats
    for n in ("attn0", "ffn0"):
        c.Heartbeat(_ref(n), _Context())
    formation = c.formation
    c.Register(_register("attn1", "attention", "i1"), _Context())
    assert c.generation == 0  # the survivors step on while the replacement loads its weights
    st = c.AwaitCluster(_ref("attn1", "i1"), _Context(5))  # loaded: it opens the next generation
    assert st.generation == c.generation == 1 and st.formation == c.formation != formation
    assert st.forming == ["attn0", "ffn0"]
    with ThreadPoolExecutor(2) as pool:  # the survivors see it in their heartbeats and move
        sts = [st, *pool.map(lambda n: _await(c, _ref(n), 0), ("attn0", "ffn0"))]
    assert {(st.generation, st.formation) for st in sts} == {(1, c.formation)}
    assert not sts[1].forming and not sts[1].lost


def test_a_failed_generation_forms_again_only_with_the_nodes_that_ask(coordinator):
    """attn0's data plane failed (its FFN peer died, say): the next generation opens at once, but it
    forms only once every node asks for it; a dead node never does, so nothing forms without it."""
    c = coordinator
    t0 = time.monotonic()
    st = _await(c, _ref("attn0"), 0, seconds=0.5)
    assert time.monotonic() - t0 >= 0.45
    assert st.generation == 1 and st.forming == ["attn1", "ffn0"]  # the client keeps waiting
    with ThreadPoolExecutor(3) as pool:
        done = [pool.submit(_await, c, _ref(n), 0) for n in ("attn0", "attn1", "ffn0")]
        sts = [f.result() for f in done]
    assert [st.generation for st in sts] == [1, 1, 1] and not any(st.forming for st in sts)  # one bump only
    assert c.Heartbeat(_ref("attn0"), _Context()).formation == ""  # heartbeats never carry the store prefix


def test_a_restarted_coordinator_learns_the_survivors_again(tmp_path):
    """Soft state: a fresh coordinator (its node restarted) takes the running nodes' registrations again,
    with their generation and readiness; its own node's new instance forms a newer generation with them,
    and the cluster is READY once that node reports ready."""
    cfg = load(str(cluster_yaml(tmp_path, str(tmp_path), 2, 1, cluster={"heartbeat_timeout": 5})))
    c = Coordinator(cfg, "fp", n_routed=4)
    c.Register(_register("attn0", "attention", "new"), _Context())  # the restarted node registers with itself
    with pytest.raises(_Aborted, match="NOT_FOUND: node 'attn1' is not registered with this coordinator"):
        c.Heartbeat(_ref("attn1"), _Context())  # a survivor's heartbeat, before it registers again
    for name, role in NODES[1:]:
        again = _register(name, role, "i0")
        again.again, again.generation, again.ready = True, 3, True
        c.Register(again, _Context())
    st = c.AwaitCluster(_ref("attn0", "new"), _Context(5))
    assert st.generation == 4 and st.formation and not st.missing  # newer than the survivors' 3
    # attn0 is not ready yet, but the survivors serve on: DEGRADED (they take requests), not STARTING
    assert c.GetStatus(pb.StatusRequest(), _Context()).state == pb.ClusterStatus.DEGRADED
    assert _await(c, _ref("ffn0"), after=3, seconds=0.2).forming == ["attn1"]
    assert _await(c, _ref("attn1"), after=3).generation == 4
    assert c.ReportReady(_ref("attn0", "new"), _Context()).state == pb.ClusterStatus.READY
    dup = _register("attn1", "attention", "other")  # the survivor is alive: its name is still taken
    with pytest.raises(_Aborted, match="ALREADY_EXISTS: duplicate node name"):
        c.Register(dup, _Context())
