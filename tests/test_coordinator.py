"""The coordinator in process: who is registered, ready, lost or draining; a replacement taken once the
old instance is lost, without the survivors noticing; soft state learnt again after a restart. It
plays no part in forming the data plane (each attention rank forms its pairs with the FFN nodes)."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import pytest
from cluster_helpers import cluster_yaml

from afd import __version__
from afd.config.loader import load
from afd.control import control_pb2 as pb
from afd.control.coordinator import Coordinator

NODES = (("attn0", "attention"), ("attn1", "attention"), ("ffn0", "ffn"))
HEARTBEAT_TIMEOUT = 1.0
"""Long against the microseconds between the calls a test compares, so a survivor never goes lost
between them on a loaded machine; short enough to wait out for a replacement."""


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


def _new(tmp_path, heartbeat_timeout: float = HEARTBEAT_TIMEOUT) -> Coordinator:
    cluster = {"heartbeat_timeout": heartbeat_timeout}
    return Coordinator(load(str(cluster_yaml(tmp_path, str(tmp_path), 2, 1, cluster=cluster))), "fp", n_routed=4)


def _register(name: str, role: str, instance: str, **fields) -> pb.RegisterRequest:
    return pb.RegisterRequest(
        name=name,
        role=role,
        address="127.0.0.1",
        instance_id=instance,
        model_fingerprint=fields.pop("fingerprint", "fp"),
        version=__version__,
        **fields,
    )


@pytest.fixture
def serving(tmp_path):
    """A READY cluster; `ids` are the instances' ids (uuid4 hex, as ControlClient makes them)."""
    c, ids = _new(tmp_path), {name: uuid.uuid4().hex for name, _ in NODES}
    for name, role in NODES:
        c.Register(_register(name, role, ids[name]), _Context())
    for name, _ in NODES:
        c.ReportReady(pb.NodeRef(name=name, instance_id=ids[name]), _Context())
    assert c.GetStatus(pb.StatusRequest(), _Context()).state == pb.ClusterStatus.READY
    return SimpleNamespace(c=c, ids=ids, ref=lambda n: pb.NodeRef(name=n, instance_id=ids[n]))


def _lose(s, name: str) -> None:
    """`name`'s instance stops sending heartbeats; the others go on."""
    time.sleep(HEARTBEAT_TIMEOUT + 0.2)
    for other, _ in NODES:
        if other != name:
            s.c.Heartbeat(s.ref(other), _Context())


def test_startup_waits_for_every_node_and_is_ready_once_all_report(tmp_path):
    c, ids = _new(tmp_path), {name: uuid.uuid4().hex for name, _ in NODES}

    def ref(n: str) -> pb.NodeRef:
        return pb.NodeRef(name=n, instance_id=ids[n])

    for name, role in NODES[:2]:
        c.Register(_register(name, role, ids[name]), _Context())
    st = c.GetStatus(pb.StatusRequest(), _Context())
    assert (st.state, list(st.missing)) == (pb.ClusterStatus.STARTING, ["ffn0"])
    assert list(st.registered) == ["attn0", "attn1"]
    with ThreadPoolExecutor(2) as pool:
        waits = [pool.submit(c.AwaitCluster, ref(n), _Context(20)) for n in ("attn0", "attn1")]
        time.sleep(0.3)
        assert not any(w.done() for w in waits)  # ffn0 is missing: they wait
        c.Register(_register("ffn0", "ffn", ids["ffn0"]), _Context())
        sts = [w.result(timeout=10) for w in waits]
    assert all(not st.missing and st.state == pb.ClusterStatus.STARTING for st in sts)
    assert c.ReportReady(ref("ffn0"), _Context()).ready == ["ffn0"]
    assert c.ReportReady(ref("attn0"), _Context()).state == pb.ClusterStatus.STARTING  # attn1 is not ready
    st = c.ReportReady(ref("attn1"), _Context())
    assert (st.state, list(st.ready), list(st.lost), st.message) == (
        pb.ClusterStatus.READY,
        ["attn0", "attn1", "ffn0"],
        [],
        "",
    )


@pytest.mark.parametrize(
    "request_, refusal",
    [
        (_register("attn9", "attention", "x"), "NOT_FOUND: unknown node 'attn9': the cluster YAML names attn0, attn1"),
        (_register("ffn0", "attention", "x"), "INVALID_ARGUMENT: node 'ffn0' registered as 'attention' but the YAML"),
        (_register("ffn0", "ffn", "x", fingerprint="other"), "FAILED_PRECONDITION: node 'ffn0' has model fingerprint"),
    ],
    ids=["unknown", "wrong-role", "other-model"],
)
def test_a_node_that_does_not_fit_the_yaml_is_refused(tmp_path, request_, refusal):
    c = _new(tmp_path)
    with pytest.raises(_Aborted, match=f"^{refusal}"):
        c.Register(request_, _Context())
    assert not c.members


def test_a_node_whose_requests_are_paused_makes_the_cluster_degraded_naming_why(serving):
    """A regression: `afd status` said READY while the only FFN node was dead and every request paused. A serving
    node's heartbeat says why its requests are paused; the cluster is DEGRADED, naming it, until one says
    they run again."""
    s, c = serving, serving.c
    why = "ffn0 (rank 2): recv failed: the peer process is probably gone; waiting for FFN node ffn0"
    st = c.Heartbeat(pb.NodeRef(name="attn1", instance_id=s.ids["attn1"], paused=why), _Context())
    assert (st.state, st.message) == (pb.ClusterStatus.DEGRADED, f"attn1: requests paused: {why}")
    assert c.GetStatus(pb.StatusRequest(), _Context()).state == pb.ClusterStatus.DEGRADED
    st = c.Heartbeat(s.ref("attn1"), _Context())  # no reason: serving again
    assert (st.state, st.message) == (pb.ClusterStatus.READY, "")


def test_a_duplicate_name_is_refused_and_a_replacement_taken_once_the_old_instance_is_lost(serving):
    s, c = serving, serving.c
    with pytest.raises(_Aborted, match="ALREADY_EXISTS: duplicate node name 'attn1': already registered from"):
        c.Register(_register("attn1", "attention", "new"), _Context())  # the old instance is alive
    c.Drain(pb.DrainRequest(node="attn1"), _Context())
    _lose(s, "attn1")
    st = c.GetStatus(pb.StatusRequest(), _Context())
    assert (st.state, list(st.lost), list(st.draining)) == (pb.ClusterStatus.DEGRADED, ["attn1"], ["attn1"])
    c.Register(_register("attn1", "attention", "new"), _Context())
    st = c.GetStatus(pb.StatusRequest(), _Context())
    # the replacement is alive, not draining (that was its predecessor), and not ready until it says so
    assert (st.state, list(st.lost), list(st.draining)) == (pb.ClusterStatus.READY, [], [])
    assert (list(st.registered), list(st.ready)) == (["attn0", "attn1", "ffn0"], ["attn0", "ffn0"])
    with pytest.raises(_Aborted, match="NOT_FOUND: node 'attn1' is not registered with this coordinator"):
        c.Heartbeat(s.ref("attn1"), _Context())  # the old instance, back from a stall: its name is taken
    assert c.ReportReady(pb.NodeRef(name="attn1", instance_id="new"), _Context()).ready == ["attn0", "attn1", "ffn0"]


def test_a_replacement_awaits_nothing_in_a_serving_cluster_and_changes_nothing_for_the_others(serving):
    """The replacement forms its own pairs with the FFN nodes; the coordinator only says the cluster is
    whole, at once, and the survivors see the same status as before it asked (no generation to move to)."""
    s, c = serving, serving.c
    _lose(s, "attn1")
    c.Register(_register("attn1", "attention", "new"), _Context())
    before = {n: c.Heartbeat(s.ref(n), _Context()) for n in ("attn0", "ffn0")}
    t0 = time.monotonic()
    st = c.AwaitCluster(pb.NodeRef(name="attn1", instance_id="new"), _Context(20))
    # returns without waiting: 1s is far above a lock and a message, far below the 20s it could block
    assert time.monotonic() - t0 < 1.0
    assert not st.missing and not st.lost and st.state == pb.ClusterStatus.READY
    after = {n: c.Heartbeat(s.ref(n), _Context()) for n in ("attn0", "ffn0")}
    assert after == before and st == before["attn0"]
    assert {n: m.instance_id for n, m in c.members.items()} == {**s.ids, "attn1": "new"}


def test_a_restarted_coordinator_learns_the_survivors_again(tmp_path):
    """Soft state: a fresh coordinator (its node restarted) takes the running nodes' registrations again,
    with their readiness; it reports DEGRADED (they keep taking requests) until its own node's new
    instance is ready, then READY."""
    c = _new(tmp_path, heartbeat_timeout=5)
    c.Register(_register("attn0", "attention", "new"), _Context())  # the restarted node registers with itself
    with pytest.raises(_Aborted, match="NOT_FOUND: node 'attn1' is not registered with this coordinator"):
        c.Heartbeat(pb.NodeRef(name="attn1", instance_id="i0"), _Context())  # before it registers again
    for name, role in NODES[1:]:
        c.Register(_register(name, role, "i0", again=True, ready=True), _Context())
    st = c.GetStatus(pb.StatusRequest(), _Context())
    assert (st.state, list(st.ready), list(st.missing)) == (pb.ClusterStatus.DEGRADED, ["attn1", "ffn0"], [])
    t0 = time.monotonic()
    st = c.AwaitCluster(pb.NodeRef(name="attn0", instance_id="new"), _Context(20))
    assert time.monotonic() - t0 < 1.0 and not st.missing  # everyone is back: nothing to wait for
    assert c.Heartbeat(pb.NodeRef(name="ffn0", instance_id="i0"), _Context()).state == pb.ClusterStatus.DEGRADED
    assert c.ReportReady(pb.NodeRef(name="attn0", instance_id="new"), _Context()).state == pb.ClusterStatus.READY
    with pytest.raises(_Aborted, match="ALREADY_EXISTS: duplicate node name"):
        c.Register(_register("attn1", "attention", "other"), _Context())  # the survivor is alive: name taken


def test_a_survivor_that_had_not_reported_ready_is_learnt_as_not_ready(tmp_path):
    c = _new(tmp_path, heartbeat_timeout=5)
    c.Register(_register("attn0", "attention", "new"), _Context())
    c.Register(_register("attn1", "attention", "i0", again=True, ready=False), _Context())
    c.Register(_register("ffn0", "ffn", "i0", again=True, ready=False), _Context())
    st = c.GetStatus(pb.StatusRequest(), _Context())
    assert (st.state, list(st.ready)) == (pb.ClusterStatus.STARTING, [])  # nobody served: still starting up


STATUS_FIELDS = {"state", "missing", "registered", "ready", "lost", "message", "draining"}


def test_no_status_carries_a_secret(serving):
    """What any caller with the token sees (heartbeats, the status CLI) names nodes and states only: no
    store prefix, no key, no instance id (with one, a process could heartbeat as that node)."""
    s, c = serving, serving.c
    names = {n for n, _ in NODES}
    sts = [c.Heartbeat(s.ref(n), _Context()) for n in names]
    sts.append(c.Drain(pb.DrainRequest(node="attn0"), _Context()))
    _lose(s, "attn1")
    sts += [c.GetStatus(pb.StatusRequest(), _Context()), c.Heartbeat(s.ref("ffn0"), _Context())]
    c.Register(_register("attn1", "attention", uuid.uuid4().hex), _Context())
    sts.append(c.AwaitCluster(pb.NodeRef(name="attn1", instance_id=c.members["attn1"].instance_id), _Context(5)))
    sts.append(c.Shutdown(pb.ShutdownRequest(reason="done"), _Context()))
    assert {tuple(st.lost) for st in sts} == {(), ("attn1",)}  # the statuses span the lifecycle
    secrets = [m.instance_id for m in c.members.values()] + list(s.ids.values())
    for st in sts:
        assert {f.name for f, _ in st.ListFields()} <= STATUS_FIELDS
        for field in STATUS_FIELDS - {"state", "message"}:
            assert set(getattr(st, field)) <= names
        assert st.message in ("", "draining", "done")
        wire = st.SerializeToString()
        assert not any(secret.encode() in wire for secret in secrets)


def test_a_node_silent_for_three_intervals_is_late_before_it_is_lost(tmp_path):
    """`late` names a suspect (silent for LATE_HEARTBEATS intervals) long before heartbeat_timeout, so
    that a node waiting on it can drop a hung peer; the cluster stays READY, and a heartbeat clears it."""
    c = _new(tmp_path, heartbeat_timeout=30)  # cluster_yaml's heartbeat_interval: 0.5 s, so late after 1.5 s
    ids = {name: uuid.uuid4().hex for name, _ in NODES}
    for name, role in NODES:
        c.Register(_register(name, role, ids[name]), _Context())
        c.ReportReady(pb.NodeRef(name=name, instance_id=ids[name]), _Context())
    time.sleep(1.7)
    for name in ("attn0", "ffn0"):
        st = c.Heartbeat(pb.NodeRef(name=name, instance_id=ids[name]), _Context())
    assert (st.state, list(st.late), list(st.lost)) == (pb.ClusterStatus.READY, ["attn1"], [])
    st = c.Heartbeat(pb.NodeRef(name="attn1", instance_id=ids["attn1"]), _Context())
    assert list(st.late) == []


def test_a_poke_sends_the_heartbeat_now_so_the_status_names_a_pause_at_once(tmp_path, monkeypatch):
    """/health says 503 the moment the engine pauses; the node's heartbeat carries the pause then
    (ControlClient.poke, from Engine.on_pause), not at the end of its interval, so afd status agrees."""
    from afd.control.client import ControlClient
    from afd.control.server import ControlServer

    monkeypatch.delenv("AFD_CLUSTER_TOKEN", raising=False)
    cluster = {"heartbeat_interval": 5.0, "heartbeat_timeout": 30}
    cfg = load(str(cluster_yaml(tmp_path, str(tmp_path), 1, 0, cluster=cluster)))
    coordinator = Coordinator(cfg, "fp", n_routed=4)
    server = ControlServer("127.0.0.1", cfg.node("attn0").ports.control, None, coordinator)
    client = ControlClient(cfg, "attn0")
    try:
        client.register("fp")
        why = {"now": ""}
        client.start_heartbeats(lambda st, asked: None, paused=lambda: why["now"])
        why["now"] = "waiting for ffn0: gone"
        client.poke()
        end = time.monotonic() + 2  # well inside the 5 s interval
        while coordinator.members["attn0"].paused != why["now"]:
            assert time.monotonic() < end, "the poked heartbeat did not arrive"
            time.sleep(0.02)
    finally:
        client.close()
        server.stop(0)
