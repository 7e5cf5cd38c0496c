"""The cluster YAML: the examples in deploy/ load, validate with `afd check-config`, show how to run them,
share no port and place their nodes on devices as they say. Every kind of mistake rejected with its key path:
test_cluster_config_mistakes.py; the node commands `afd launch --print-commands` prints:
test_cluster_config_launch.py. (The Kubernetes manifests: test_k8s_manifests.py.)

Fast: the only processes are `afd` CLI calls, run a few at a time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cluster_config_helpers import DEPLOY, ROOT, afd_many

from afd.config.loader import load
from afd.model.demo import DEMO_CONFIG

EXAMPLES = sorted(DEPLOY.glob("*.yaml"))
TOPOLOGY = {"local.yaml": "1A1F", "2a1f.yaml": "2A1F", "1a2f.yaml": "1A2F", "cuda-1a1f.yaml": "1A1F"}


# ---- the examples in deploy/ --------------------------------------------------------------------


def test_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"local.yaml", "2a1f.yaml", "1a2f.yaml", "ascend-multihost.yaml", "cuda.yaml", "cuda-1a1f.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_loads(path: Path):
    cfg = load(str(path))
    assert cfg.attention_nodes and cfg.ffn_nodes
    if path.name in TOPOLOGY:
        assert cfg.topology_name == TOPOLOGY[path.name]
    # the coordinator hosts the data-plane rendezvous, which data-plane rank 0 serves
    assert cfg.rank(cfg.coordinator.name) == 0


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_starts_with_how_to_run_it(path: Path):
    text = path.read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    assert text.startswith("# ")
    assert f"afd check-config deploy/{path.name}" in header or f"afd launch deploy/{path.name}" in header
    assert "afd launch" in header


def test_check_config_accepts_every_example():
    runs = afd_many({p.name: ["check-config", str(p.relative_to(ROOT))] for p in EXAMPLES})
    for name, r in runs.items():
        assert r.returncode == 0, f"{name}: {r.stderr}"
        cfg = load(str(DEPLOY / name))
        assert f"{cfg.topology_name}, model {cfg.model.path}" in r.stdout
        for node in cfg.nodes:
            assert node.name in r.stdout


def test_check_config_prints_the_placement_fan_out_and_bytes():
    r = afd_many({"1a2f": ["check-config", "deploy/1a2f.yaml"]})["1a2f"]
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "expert placement (16 routed experts, top-4, routing attention):" in out
    assert "ffn0         10 experts: 0-9" in out and "ffn1          6 experts: 10-15" in out
    # the demo's uniform fan-out over its routed picks only (its 4 identity experts never cross): k of the 4
    # picks routed with P(k) = C(16,k) C(4,4-k) / C(20,4), and 2 - C(10,k)/C(16,k) - C(6,k)/C(16,k) nodes then:
    # (64 x 1 + 720 x 1.5 + 2240 x 1.75 + 1820 x 1.8764) / 4845 = 8479 / 4845 = 1.75005
    assert "fan-out per token: 1.75 of 2 FFN nodes expected (uniform routing), at most 2" in out
    assert "broadcast to_ffn               2048.0" in out  # 2 nodes x 256 float32
    assert "dispatch to_ffn                1848.1" in out  # 1.75005 x (1024 + 4 x 8)


def test_examples_share_no_port():
    """So that any two examples run side by side on one machine."""
    seen: dict[int, str] = {}
    for path in EXAMPLES:
        for node in load(str(path)).nodes:
            for kind in ("control", "data", "http", "metrics"):
                port = getattr(node.ports, kind)
                if port is not None:
                    where = f"{path.name}:{node.name}.ports.{kind}"
                    assert port not in seen, f"{where} reuses port {port} of {seen[port]}"
                    seen[port] = where


def test_1a2f_places_the_demo_experts_explicitly():
    cfg = load(str(DEPLOY / "1a2f.yaml"))
    p = cfg.placement(DEMO_CONFIG["n_routed_experts"])
    assert p.held == (tuple(range(10)), tuple(range(10, 16)))
    assert cfg.routing == "attention" and not any(cfg.serves_zero(n) for n in p.nodes)


def test_device_examples():
    ascend = load(str(DEPLOY / "ascend-multihost.yaml"))
    assert ascend.model.dtype == "bfloat16" and {n.device_type for n in ascend.nodes} == {"npu"}
    assert len({n.host for n in ascend.nodes}) == len(ascend.nodes) >= 4
    assert "HCCL_IF_IP" in (DEPLOY / "ascend-multihost.yaml").read_text()
    cuda = load(str(DEPLOY / "cuda.yaml"))
    assert {n.device_type for n in cuda.nodes} == {"cuda"}
    assert len({n.device for n in cuda.nodes}) == len(cuda.nodes)  # one GPU per node
    assert "NCCL_SOCKET_IFNAME" in (DEPLOY / "cuda.yaml").read_text()
    two = load(str(DEPLOY / "cuda-1a1f.yaml"))  # the example for a 2-GPU machine, which cuda.yaml points at
    assert [n.device for n in two.nodes] == ["cuda:0", "cuda:1"] and two.model.dtype == "bfloat16"
    assert "deploy/cuda-1a1f.yaml" in (DEPLOY / "cuda.yaml").read_text()
