"""Two "hosts" on one machine: the FFN node in a network namespace of its own, joined to this one by a
veth pair, so the control plane and the data plane cross a real interface, not loopback. Needs root and
iproute2 (it skips with the reason otherwise); it only touches the namespace and addresses it makes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import yaml
from cluster_helpers import ROOT, free_ports, health, post
from hf_reference import PROMPTS, hf_greedy

pytestmark = pytest.mark.multiprocess
ATTN_IP, FFN_IP = "10.77.0.1", "10.77.0.2"


def _ip(*args, ns: str | None = None) -> None:
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture
def ffn_host():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make a network namespace")
    tag = str(os.getpid() % 100000)
    ns, va, vb = f"afd-ffn-{tag}", f"afdva{tag}", f"afdvb{tag}"
    try:
        _ip("netns", "add", ns)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot make a network namespace here: {e.stderr.decode().strip()}")
    try:
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        _ip("link", "set", vb, "netns", ns)
        _ip("addr", "add", f"{ATTN_IP}/24", "dev", va)
        _ip("link", "set", va, "up")
        _ip("addr", "add", f"{FFN_IP}/24", "dev", vb, ns=ns)
        _ip("link", "set", vb, "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        yield ns, va, vb
    finally:
        subprocess.run(["ip", "link", "del", va], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_attention_and_ffn_on_different_hosts(tiny_checkpoint, tmp_path, ffn_host):
    ns, va, vb = ffn_host
    p = iter(free_ports(6))
    doc = {
        "cluster": {"name": "two-hosts", "startup_timeout": 60, "comm_timeout": 30},
        "model": {"path": tiny_checkpoint},
        "nodes": [
            {
                "name": "attn0",
                "role": "attention",
                "host": ATTN_IP,
                "ports": {"control": next(p), "data": next(p), "http": next(p)},
            },
            {
                "name": "ffn0",
                "role": "ffn",
                "host": FFN_IP,
                "ports": {"control": next(p), "data": next(p), "metrics": next(p)},
            },
        ],
    }
    cfg = tmp_path / "two-hosts.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    # off loopback, a node without a cluster token is refused before it opens any port
    bare = {k: v for k, v in os.environ.items() if k != "AFD_CLUSTER_TOKEN"}
    r = subprocess.run(
        [sys.executable, "-m", "attention_node.main", "--config", str(cfg), "--node", "attn0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=bare,
    )
    assert r.returncode == 2 and "AFD_CLUSTER_TOKEN is not set" in r.stderr, r.stderr
    token = {"AFD_CLUSTER_TOKEN": "two-hosts-secret"}
    from afd.cluster.processes import NodeProcesses, node_command

    procs = NodeProcesses(str(tmp_path), env={**os.environ, **token}, cwd=ROOT)
    procs.start(
        node_command(str(cfg), "ffn", "ffn0", args=["--bind-host", FFN_IP], prefix=["ip", "netns", "exec", ns]),
        env={"GLOO_SOCKET_IFNAME": vb},
    )
    procs.start(
        node_command(str(cfg), "attention", "attn0", args=["--bind-host", ATTN_IP]), env={"GLOO_SOCKET_IFNAME": va}
    )
    url = f"http://{ATTN_IP}:{doc['nodes'][0]['ports']['http']}"
    with procs:
        procs.wait_until(lambda: health(url) == 200, 90, "the two-host cluster to be ready", every=0.2)
        want = [ids for ids, _ in hf_greedy(tiny_checkpoint, PROMPTS, 8)]
        for prompt, ids in zip(PROMPTS, want):
            code, body = post(
                url, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
            )
            assert code == 200 and body["choices"][0]["token_ids"] == ids
        assert f"registered ffn0 (ffn) from {FFN_IP}" in procs.log("attn0")


def test_a_job_behind_an_emulated_link_equals_hf(tiny_checkpoint):
    """The FFN node behind a shaped veth (afd bench-step --link): the exchange really crosses it, and
    gloo listens on each node's own address (torch passes no options to gloo: GLOO_SOCKET_IFNAME)."""
    from afd.cluster.link import EmulatedLink, LinkError, LinkSpec
    from afd.cluster.local import LocalCluster
    from afd.cluster.local_config import local_job

    try:
        link = EmulatedLink(LinkSpec.parse("1gbit")).__enter__()
    except LinkError as e:
        pytest.skip(str(e))
    try:
        with LocalCluster(
            local_job(tiny_checkpoint, **link.hosts, micro_batches=2), ffn_command_prefix=link.prefix
        ) as c:
            c.start(PROMPTS, 8)
            got, _ = c.wait()
    finally:
        link.__exit__()
    assert got == [ids for ids, _ in hf_greedy(tiny_checkpoint, PROMPTS, 8)]


@pytest.mark.parametrize(
    "text,want", [("25gbit,20us", ("25gbit", "20us")), ("10gbit", ("10gbit", None)), (",1ms", (None, "1ms"))]
)
def test_link_specs(text, want):
    from afd.cluster.link import LinkSpec

    spec = LinkSpec.parse(text)
    assert (spec.rate, spec.delay) == want


@pytest.mark.parametrize("text", ["fast", "25gb", "10gbit,soon", ","])
def test_bad_link_specs_are_refused(text):
    from afd.cluster.link import LinkSpec

    with pytest.raises(ValueError, match="--link"):
        LinkSpec.parse(text)


def test_gloo_is_told_the_interface_of_the_bind_address():
    from afd.dataplane.rendezvous import _interface_of

    assert _interface_of("127.0.0.1") == "lo" and _interface_of("192.0.2.77") is None
