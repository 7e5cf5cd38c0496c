"""Nodes started by hand from a cluster YAML, in any order; the coordinator's checks; afd launch."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from cluster_helpers import ROOT, Cluster, cluster_yaml, free_ports, health, post, stop_launcher
from hf_reference import PROMPTS

from afd.cluster.processes import Command, NodeProcesses, descendants

pytestmark = pytest.mark.multiprocess
NEW = 12


@pytest.fixture(scope="module")
def reference(families):
    return families.ref_ids("longcat_flash", "zero_experts", NEW)  # tiny_checkpoint's


def _greedy(url: str, prompt) -> list[int]:
    code, body = post(
        url, "/v1/completions", {"prompt": prompt, "max_tokens": NEW, "temperature": 0, "return_token_ids": True}
    )
    assert code == 200, body
    return body["choices"][0]["token_ids"]


def _reverse_started_serve_hf_tokens(c: Cluster, reference, attention: int) -> None:
    urls = [c.url(f"attn{i}") for i in range(attention)]
    jobs = [(urls[i % attention], p) for i, p in enumerate(PROMPTS * 2)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: _greedy(*j), jobs))
    assert got == [reference[PROMPTS.index(p)] for _, p in jobs]


@pytest.fixture(scope="module")
def secret_1a1f(tiny_checkpoint, tmp_path_factory):
    """(YAML, cluster): 1A1F under a cluster token, started in reverse order (the FFN node first, the
    coordinator's node last). The reverse-order case at 1A1F and the wrong-token case run on it, which each
    leave it serving: one start of node processes for the two."""
    path = cluster_yaml(tmp_path_factory.mktemp("auth"), tiny_checkpoint, name="auth")
    with Cluster(path, env={"AFD_CLUSTER_TOKEN": "s3cret"}) as c:
        c.start_all(reverse=True)
        c.wait_ready()
        yield path, c


def test_nodes_started_in_reverse_order_serve_hf_tokens(secret_1a1f, reference):
    _reverse_started_serve_hf_tokens(secret_1a1f[1], reference, 1)


@pytest.mark.slow  # the 1A1F case above, at more nodes
@pytest.mark.parametrize("attention,ffn", [(2, 1), (1, 2)])
def test_nodes_started_in_reverse_order_serve_hf_tokens_at_more_nodes(
    tiny_checkpoint, reference, tmp_path, attention, ffn
):
    path = cluster_yaml(tmp_path, tiny_checkpoint, attention, ffn, name=f"c{attention}a{ffn}f")
    with Cluster(path) as c:
        c.start_all(reverse=True)  # FFN nodes first, the coordinator's node last
        c.wait_ready()
        _reverse_started_serve_hf_tokens(c, reference, attention)


def test_wrong_token_is_refused_and_the_cluster_keeps_serving(secret_1a1f, reference, tmp_path):
    path, c = secret_1a1f
    # the same node name from "another host": its own ports are free, the coordinator is the cluster's
    doc = yaml.safe_load(path.read_text())
    control, metrics = free_ports(2)
    doc["nodes"][1]["ports"].update(control=control, metrics=metrics)
    other = tmp_path / "intruder.yaml"
    other.write_text(yaml.safe_dump(doc))
    intruder = subprocess.run(
        [
            sys.executable,
            "-m",
            "ffn_node.main",
            "--config",
            str(other),
            "--node",
            "ffn0",
            "--bind-host",
            "127.0.0.1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "AFD_CLUSTER_TOKEN": "wrong"},
    )
    assert intruder.returncode != 0
    assert "cluster token mismatch" in intruder.stdout + intruder.stderr
    assert health(c.url()) == 200
    assert _greedy(c.url(), PROMPTS[3]) == reference[3]


def test_startup_timeout_names_the_missing_nodes(tiny_checkpoint, tmp_path):
    path = cluster_yaml(tmp_path, tiny_checkpoint, 1, 2, name="timeout", cluster={"startup_timeout": 3})
    with Cluster(path) as c:
        p = c.start("attn0")
        assert p.wait(30) == 1
        log = c.log("attn0")
        assert "nodes never registered: ffn0, ffn1" in log


def test_different_model_is_refused(tiny_checkpoints, tmp_path):
    path = cluster_yaml(tmp_path, tiny_checkpoints["zero_experts"], name="fingerprint")
    with Cluster(path) as c:
        c.start("attn0")
        p = c.start("ffn0", ["--model", tiny_checkpoints["no_zero_experts"]])
        assert p.wait(60) == 1
        assert "model fingerprint" in c.log("ffn0") and "a different model" in c.log("ffn0")


def _listeners() -> dict[int, set[tuple[str, int]]]:
    """Listening TCP sockets of this host: socket inode -> {(local address, port)} (/proc/net/tcp and tcp6;
    an IPv4-mapped IPv6 address is shown as its IPv4 address, the IPv6 wildcard as '::')."""
    import ipaddress

    out: dict[int, set[tuple[str, int]]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            addr, port = fields[1].split(":")
            raw = b"".join(bytes.fromhex(addr[i : i + 8])[::-1] for i in range(0, len(addr), 8))  # host-order words
            ip = ipaddress.ip_address(raw)
            if ip.version == 6 and ip.ipv4_mapped:
                ip = ip.ipv4_mapped
            out.setdefault(int(fields[9]), set()).add((str(ip), int(port, 16)))
    return out


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def _launched_cluster_is_closed(path: Path, url: str, launcher_pid: int) -> None:
    """`afd launch` without AFD_CLUSTER_TOKEN makes one: a forged Shutdown is refused, `afd status` (same
    user) still works, and the nodes' control, API and metrics ports listen on the YAML host only."""
    import grpc

    from afd.control import control_pb2 as pb
    from afd.control import control_pb2_grpc as pb_grpc

    doc = yaml.safe_load(path.read_text())
    coord = doc["nodes"][0]["ports"]["control"]
    for metadata in ((), (("x-afd-cluster-token", "guessed"),)):  # no token, a wrong one
        with grpc.insecure_channel(f"127.0.0.1:{coord}") as ch, pytest.raises(grpc.RpcError) as e:
            pb_grpc.CoordinatorStub(ch).Shutdown(pb.ShutdownRequest(reason="forged"), metadata=metadata, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # nor does the rendezvous store answer: no key count, no pair address
        with grpc.insecure_channel(f"127.0.0.1:{coord}") as ch, pytest.raises(grpc.RpcError) as e:
            pb_grpc.RendezvousStub(ch).NumKeys(pb.StoreRequest(), metadata=metadata, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # the old TCPStore port (rank 0's ports.data) has nothing listening: no plain-TCP store to read
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", doc["nodes"][0]["ports"]["data"]), timeout=5).close()
    assert health(url) == 200
    env = {k: v for k, v in os.environ.items() if k != "AFD_CLUSTER_TOKEN"}
    status = subprocess.run(
        [sys.executable, "-m", "afd", "status", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert status.returncode == 0, status.stdout + status.stderr
    listening = _listeners()
    by_port = {port: addr for socks in listening.values() for addr, port in socks}
    for node in doc["nodes"]:
        for kind in ("control", "http", "metrics"):
            port = node["ports"].get(kind)
            if port:
                assert by_port.get(port) == "127.0.0.1", (node["name"], kind, by_port.get(port))
    # every listener of every node (the rendezvous store and gloo's pairs included) is on the YAML host
    for pid in descendants(launcher_pid):
        for inode in _socket_inodes(pid) & set(listening):
            assert {addr for addr, _ in listening[inode]} == {"127.0.0.1"}, (pid, listening[inode])


def test_sigterm_to_afd_launch_leaves_no_process_behind(tiny_checkpoint, tmp_path):
    path = cluster_yaml(tmp_path, tiny_checkpoint, 2, 1, name="launch")
    procs = NodeProcesses(str(tmp_path), cwd=ROOT)
    launcher = procs.start(Command("afd-launch", (sys.executable, "-m", "afd", "launch", str(path))))
    try:

        def url_line() -> list[str]:
            return [line for line in procs.log("afd-launch").splitlines() if line.startswith("http://")]

        procs.wait_until(url_line, 90, "afd launch to print its URL")
        url = url_line()[0]
        assert url and health(url) == 200
        _launched_cluster_is_closed(path, url, launcher.pid)
        children = descendants(launcher.pid)
        assert len(children) >= 3
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(60) == 0
        alive = [
            pid
            for pid in children
            if os.path.exists(f"/proc/{pid}") and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
        ]
        assert alive == []
    finally:
        stop_launcher(launcher, procs)


def test_one_attention_node_leaving_does_not_stop_the_others(tiny_checkpoint, reference, tmp_path):
    path = cluster_yaml(tmp_path, tiny_checkpoint, 2, 1, name="leave", cluster={"heartbeat_timeout": 2})
    with Cluster(path) as c:
        c.start_all()
        c.wait_ready()
        c.procs["attn1"].send_signal(signal.SIGTERM)
        assert c.procs["attn1"].wait(20) == 0
        time.sleep(3)  # past the heartbeat timeout: the coordinator has noticed attn1 is gone
        assert c.procs["ffn0"].poll() is None
        assert health(c.url("attn0")) == 200
        assert _greedy(c.url("attn0"), PROMPTS[0]) == reference[0]
        assert "attention rank 1 (attn1) left" in c.log("ffn0")
        status = subprocess.run(
            [sys.executable, "-m", "afd", "status", str(path), "--json"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
        st = json.loads(status.stdout)
        assert status.returncode == 1 and st["state"] == "DEGRADED" and st["lost"] == ["attn1"]


@pytest.mark.slow  # CI runs it in make test-slow
def test_drain_refuses_new_requests_and_lets_running_ones_finish(tiny_checkpoint, tmp_path):
    path = cluster_yaml(tmp_path, tiny_checkpoint, 1, 1, name="drain", cluster={"heartbeat_interval": 0.2})
    with Cluster(path) as c:
        c.start_all()
        c.wait_ready()
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(
                post,
                c.url(),
                "/v1/completions",
                {"prompt": PROMPTS[0], "max_tokens": 300, "temperature": 0, "ignore_eos": True},
            )
            end = time.monotonic() + 30
            while "afd_num_requests_running{" not in _metric_lines(c.url(), " 1.0"):
                assert time.monotonic() < end, "the long request never started"
                time.sleep(0.05)
            drain = subprocess.run(
                [sys.executable, "-m", "afd", "drain", str(path), "--node", "attn0", "--wait", "120"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=180,
            )
            code, body = running.result(timeout=60)
        assert drain.returncode == 0 and "no request running" in drain.stdout, drain.stdout + drain.stderr
        assert code == 200 and body["usage"]["completion_tokens"] == 300
        assert health(c.url()) == 503
        code, err = post(c.url(), "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 2})
        assert code == 503 and "draining" in err["error"]["message"]
        bad = subprocess.run(
            [sys.executable, "-m", "afd", "drain", str(path), "--node", "ffn0"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert bad.returncode == 2 and "not an attention node" in bad.stderr


def _metric_lines(url: str, suffix: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        return "\n".join(line for line in r.read().decode().splitlines() if line.endswith(suffix))
