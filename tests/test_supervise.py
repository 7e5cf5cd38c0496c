"""The restart policy (afd.cluster.supervise) on a clock of its own, then the launcher (afd.cluster.processes)
restarting stand-in processes: back-off, the limit in a row, the count handed to each new process, and a
restart that waits for the dead process's ports."""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import time
from pathlib import Path

import pytest

from afd.cluster.host import free_ports
from afd.cluster.processes import Command, NodeExited, NodeProcesses
from afd.cluster.supervise import BACKOFF_CAP, RESTARTS_ENV, GiveUp, RestartPolicy, Supervisor

ROOT = Path(__file__).resolve().parent.parent


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_back_off_doubles_up_to_its_cap():
    p = RestartPolicy(max_restarts=10, backoff=1.5)
    assert [p.delay(r) for r in range(6)] == [1.5, 3.0, 6.0, 12.0, 24.0, BACKOFF_CAP]
    assert p.delay(10_000) == BACKOFF_CAP
    assert RestartPolicy(backoff=0.0).delay(3) == 0.0


def test_a_row_of_failures_ends_in_give_up_and_a_long_run_starts_a_new_row():
    clock, said = Clock(), []
    sup = Supervisor(RestartPolicy(max_restarts=2, backoff=1.0, reset_after=60.0), said.append, clock)
    sup.started("ffn0")
    for row, delay in ((1, 1.0), (2, 2.0)):
        clock.now += 5
        sup.failed("ffn0", "exited with code -9")
        assert (
            said[-1]
            == f"node ffn0 exited with code -9; restarting it in {delay:g}s (restart {row} of at most 2 in a row)"
        )
        clock.now += delay - 0.01
        assert sup.due() == [] and sup.pending("ffn0")
        clock.now += 0.01
        assert sup.due() == ["ffn0"]
        assert sup.restarting("ffn0") == {RESTARTS_ENV: str(row)}
        sup.started("ffn0")
    clock.now += 5
    with pytest.raises(
        GiveUp,
        match=r"^node ffn0 exited with code 1; 2 restarts in a row already \(cluster.max_restarts: 2\); giving up$",
    ):
        sup.failed("ffn0", "exited with code 1")
    # up for reset_after since its last start: a new row, back to the first back-off; the total goes on
    clock.now += 60
    sup.failed("ffn0", "exited with code -9")
    assert said[-1].endswith("restarting it in 1s (restart 1 of at most 2 in a row)")
    clock.now += 1
    assert sup.restarting("ffn0") == {RESTARTS_ENV: "3"}


def test_no_restart_when_the_limit_is_zero():
    sup = Supervisor(RestartPolicy(max_restarts=0), lambda _: None, Clock())
    with pytest.raises(GiveUp, match=r"restarts are off \(cluster.max_restarts: 0\)"):
        sup.failed("attn0", "exited with code 3")


# prints the restart count it was given, then exits with argv[1] (or runs until killed: "run")
STAND_IN = f"""
import os, sys, time
print("start", os.environ.get({RESTARTS_ENV!r}, "0"), flush=True)
if sys.argv[1] != "run":
    raise SystemExit(int(sys.argv[1]))
while True:
    time.sleep(0.05)
"""


def _starts(procs: NodeProcesses, name: str) -> list[str]:
    return [line.split()[1] for line in procs.log(name).splitlines() if line.startswith("start ")]


def test_a_process_failing_on_every_start_is_restarted_then_given_up(tmp_path):
    policy = RestartPolicy(max_restarts=2, backoff=0.05)
    with NodeProcesses(str(tmp_path), restart=policy) as procs:
        procs.start(Command("ffn0", (sys.executable, "-c", STAND_IN, "3"), "ffn"))
        t0 = time.monotonic()
        with pytest.raises(NodeExited, match=r"node ffn0 exited with code 3; 2 restarts in a row already") as e:
            procs.wait_until(lambda: False, 60, "nothing")
        assert time.monotonic() - t0 >= 0.05 + 0.1  # the back-offs were waited
        assert str(e.value).endswith("its log ends:\nstart 0\nstart 1\nstart 2\n")
        assert _starts(procs, "ffn0") == ["0", "1", "2"]  # one log, appended: every run's lines are kept


def test_a_killed_process_is_restarted_with_its_count_and_a_clean_exit_is_not(tmp_path, caplog):
    with NodeProcesses(str(tmp_path), restart=RestartPolicy(backoff=0.05)) as procs:
        first = procs.start(Command("attn0", (sys.executable, "-c", STAND_IN, "run"), "attention"))
        procs.wait_until(lambda: _starts(procs, "attn0") == ["0"], 30, "the first start")
        first.kill()
        procs.wait_until(lambda: _starts(procs, "attn0") == ["0", "1"], 30, "the restart")
        assert procs.popen("attn0").pid != first.pid and procs.supervisor.restarts("attn0") == 1
        procs.start(Command("ffn0", (sys.executable, "-c", STAND_IN, "0"), "ffn"))
        with pytest.raises(NodeExited, match="node ffn0 exited with code 0; its log ends"):
            procs.wait_until(lambda: False, 30, "nothing")  # exit 0: asked to stop, never restarted
        for _ in range(3):  # a launcher's steady watch takes a clean exit: said once, not restarted
            procs.check(exited_ok=True)
        said = [r.getMessage() for r in caplog.records if "ffn0" in r.getMessage()]
        assert said == ["node ffn0 exited with code 0 (it was asked to stop); not restarting it"]
        assert _starts(procs, "ffn0") == ["0"] and procs.supervisor.restarts("ffn0") == 0


def test_a_restart_waits_for_the_dead_process_ports(tmp_path):
    (port,) = free_ports(1)
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()  # what the dead process left behind, say
    policy = RestartPolicy(backoff=0.0, port_wait=30.0)
    with NodeProcesses(str(tmp_path), restart=policy) as procs:
        procs.start(Command("ffn0", (sys.executable, "-c", STAND_IN, "run"), "ffn", (port,)))
        procs.wait_until(lambda: _starts(procs, "ffn0") == ["0"], 30, "the first start")
        procs.popen("ffn0").kill()
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            procs.check()
            time.sleep(0.05)
        assert _starts(procs, "ffn0") == ["0"] and procs.supervisor.pending("ffn0")
        holder.close()
        procs.wait_until(lambda: _starts(procs, "ffn0") == ["0", "1"], 30, "the restart once the port is free")


def test_ports_still_taken_after_the_wait_fail_the_restart(tmp_path):
    (port,) = free_ports(1)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        policy = RestartPolicy(max_restarts=1, backoff=0.0, port_wait=0.3)
        with NodeProcesses(str(tmp_path), restart=policy) as procs:
            procs.start(Command("ffn0", (sys.executable, "-c", STAND_IN, "5"), "ffn", (port,)))
            with pytest.raises(
                NodeExited,
                match=rf"could not be restarted: port\(s\) {port} still in use after 0.3s; 1 restart in a row already",
            ):
                procs.wait_until(lambda: False, 30, "nothing")
    assert os.environ.get(RESTARTS_ENV) is None  # the count goes to the child only


def test_a_control_call_after_close_is_one_line_not_a_traceback():
    """A node stopped by a signal closes its control channel while its main thread may still be in a
    control call (waiting for the cluster): that call ends in a ControlError the node logs in one line."""
    from afd.config.loader import load
    from afd.control.client import ControlClient, ControlError

    client = ControlClient(load(str(ROOT / "deploy/2a1f.yaml")), "ffn0")
    client.close()
    with pytest.raises(ControlError, match="^ffn0 is stopping: its control channel is closed$"):
        client.await_cluster()


def test_an_ffn_node_that_never_comes_back_is_one_line_not_a_traceback(tmp_path, caplog):
    """An attention rank waits for a dead FFN node's replacement by forming its pair with it again and
    again (afd.node.pairing.form_pairs); past the deadline that ends the node's start (or its requests)
    with one line naming the FFN node, logged without a traceback, and exit code 1."""
    from cluster_helpers import cluster_yaml

    from afd.backend import get_backend
    from afd.config.loader import load
    from afd.control.client import ControlClient
    from afd.dataplane.transport import DataPlane
    from afd.node.pairing import FFNPeer, form_pairs
    from afd.node.process import run_node

    cfg = load(str(cluster_yaml(tmp_path, str(tmp_path), 1, 1)))  # free ports: nothing serves ffn0's
    backend = get_backend("cpu")
    me = ControlClient(cfg, "attn0").ref
    peer = FFNPeer(cfg, cfg.rank("ffn0"), timeout_s=5)

    class Node:
        def start(self):
            form_pairs(DataPlane(backend, cfg.rank("attn0"), 5), [peer], me, 1.0, backend)

        def serve(self):
            pytest.fail("it never started")

        def stop(self):
            pass

    caplog.set_level(logging.INFO, "afd.node")
    t0 = time.monotonic()
    try:
        assert run_node(Node(), logging.getLogger("afd.test")) == 1
    finally:
        peer.close()
    assert time.monotonic() - t0 >= 1.0  # it tried until its deadline
    (failed,) = [r for r in caplog.records if r.name == "afd.test"]
    said = failed.getMessage()
    assert re.fullmatch(r"startup failed: no pair formed with FFN node ffn0 within 1s \(last: [^\n]+\)", said), said
    assert failed.exc_info is None and "Traceback" not in caplog.text
    waiting = [r.getMessage() for r in caplog.records if r.name == "afd.node"]
    assert len(waiting) == 1 and waiting[0].startswith("waiting for FFN node ffn0 to form a pair: ")  # said once


def test_waiting_for_an_ffn_node_ends_when_the_cluster_shuts_down(tmp_path):
    """A rank that waits for a dead FFN node's replacement stops waiting once the cluster shuts down (the
    heartbeat thread sets the node's shutdown event), not after the whole deadline."""
    import threading

    from cluster_helpers import cluster_yaml

    from afd.backend import get_backend
    from afd.config.loader import load
    from afd.control.client import ControlClient, ControlError
    from afd.dataplane.transport import DataPlane
    from afd.node.pairing import FFNPeer, form_pairs

    cfg = load(str(cluster_yaml(tmp_path, str(tmp_path), 1, 1)))  # free ports: nothing serves ffn0's
    backend, stop = get_backend("cpu"), threading.Event()
    peer = FFNPeer(cfg, cfg.rank("ffn0"), timeout_s=5)
    threading.Timer(0.5, stop.set).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(ControlError, match="the cluster is shutting down: no pair formed with FFN node ffn0"):
            form_pairs(
                DataPlane(backend, cfg.rank("attn0"), 5), [peer], ControlClient(cfg, "attn0").ref, 30, backend, stop
            )
    finally:
        peer.close()
    assert time.monotonic() - t0 < 5, "it waited on past the shutdown"


def test_the_policy_is_a_cluster_setting_with_flags():
    import subprocess

    import yaml

    from afd.cluster.local_config import local_config
    from afd.config.loader import from_dict, load
    from afd.config.schema import ClusterConfigError

    cfg = load(str(ROOT / "deploy/2a1f.yaml"))
    assert RestartPolicy.of(cfg.cluster) == RestartPolicy(5, 1.0, cfg.cluster.startup_timeout)
    for key, bad in (("max_restarts", -1), ("restart_backoff", -0.5)):
        doc = local_config(1, 1).to_dict()
        doc["cluster"][key] = bad
        with pytest.raises(ClusterConfigError, match=rf"cluster.{key}: must be >= 0, got {bad}"):
            from_dict(doc)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "afd",
            "serve",
            "demo",
            "--max-restarts",
            "0",
            "--restart-backoff",
            "2.5",
            "--print-config",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    cluster = yaml.safe_load(r.stdout)["cluster"]
    assert (cluster["max_restarts"], cluster["restart_backoff"]) == (0, 2.5)


def test_the_processes_of_a_unit_restart_together(tmp_path, caplog):
    """A node's TP ranks form one group: one that dies takes the others down, and all start again."""
    with NodeProcesses(str(tmp_path), restart=RestartPolicy(backoff=0.05)) as procs:
        for name, stage in (("attn0", "attention"), ("attn0.tp1", "tp"), ("ffn0", "ffn")):
            procs.start(Command(name, (sys.executable, "-c", STAND_IN, "run"), stage, unit=name.split(".")[0]))
        procs.wait_until(lambda: all(_starts(procs, n) == ["0"] for n in procs.procs), 30, "the first starts")
        ffn = procs.popen("ffn0").pid
        procs.popen("attn0.tp1").kill()
        procs.wait_until(
            lambda: all(_starts(procs, n) == ["0", "1"] for n in ("attn0", "attn0.tp1")), 30, "the node's restart"
        )
        assert procs.supervisor.restarts("attn0") == 1 and procs.popen("ffn0").pid == ffn
        said = caplog.records[0].getMessage()
        assert said.startswith("node attn0 lost its process attn0.tp1, which exited with code -9; restarting it")
        assert all(procs.popen(n).poll() is None for n in procs.procs)


def test_ports_that_stay_taken_use_up_the_row_even_after_a_long_run():
    """A node that ran for long, then died leaving its port taken: each failed attempt continues the row
    (it is not a new failure of a node that had started), so the launcher gives up in the end."""
    (port,) = free_ports(1)
    clock = Clock()
    sup = Supervisor(RestartPolicy(max_restarts=2, backoff=1.0, reset_after=60.0, port_wait=5.0), lambda _: None, clock)
    sup.started("ffn0")
    clock.now += 1000
    sup.failed("ffn0", "exited with code -9")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        clock.now += 10
        assert not sup.ports_ready("ffn0", (port,)) and sup.pending("ffn0")
        clock.now += 10
        with pytest.raises(GiveUp, match=rf"port\(s\) {port} still in use after 5s; 2 restarts in a row already"):
            sup.ports_ready("ffn0", (port,))
