"""The cluster YAML's mistakes: each kind, an edit of one valid base file, is rejected by load() and by
`afd check-config` with its key path and the problem, in one message; nodes on their own devices (GPUs of a
host, one per host or pod, CPUs) are accepted, as is a Kubernetes rendering at any size.

Fast: the `afd check-config` calls run inside one process.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from cluster_config_helpers import DEPLOY, afd_many

from afd.config.loader import from_dict, load
from afd.config.schema import ClusterConfig, ClusterConfigError

# ---- mistakes -----------------------------------------------------------------------------------


def valid() -> dict:
    """A correct 1A2F cluster; each mistake below edits one thing."""
    return {
        "cluster": {"name": "t"},
        "model": {"path": "demo"},
        "nodes": [
            {
                "name": "attn0",
                "role": "attention",
                "host": "127.0.0.1",
                "ports": {"control": 50001, "data": 50002, "http": 50003},
            },
            {
                "name": "ffn0",
                "role": "ffn",
                "host": "127.0.0.1",
                "ports": {"control": 50004, "data": 50005, "metrics": 50006},
            },
            {
                "name": "ffn1",
                "role": "ffn",
                "host": "127.0.0.1",
                "ports": {"control": 50007, "data": 50008, "metrics": 50009},
            },
        ],
    }


def node(i: int) -> Callable[[dict], dict]:
    return lambda c: c["nodes"][i]


def layout(**kw) -> Callable[[dict], None]:
    return lambda c: c.setdefault("layout", {}).update(kw)


def devices(*per_node: str | None, hosts: tuple[str, ...] = ()) -> Callable[[dict], None]:
    """Node i's device per_node[i] (None: left out, so cpu), and its host hosts[i] where given."""

    def edit(c: dict) -> None:
        for n, dev in zip(c["nodes"], per_node):
            if dev is not None:
                n["device"] = dev
        for n, host in zip(c["nodes"], hosts):
            n["host"] = host

    return edit


# id, the mistake (an edit of valid(), raw file text, or None: no file at all), key path, the problem
MISTAKES = [
    ("unknown-top-level-key", lambda c: c.update(servers=[]), "servers", "unknown key (known: cluster, model"),
    (
        "unknown-nested-key",
        lambda c: node(0)(c)["ports"].update(htp=8000),
        "nodes[0].ports.htp",
        "unknown key (known: control, data, http, metrics)",
    ),
    ("unknown-section-key", lambda c: c["model"].update(branch="main"), "model.branch", "unknown key"),
    (
        "wrong-type-int",
        lambda c: c.update(engine={"block_size": "16"}),
        "engine.block_size",
        "expected int, got str '16'",
    ),
    ("wrong-type-bool", layout(overlap="yes"), "layout.overlap", "expected bool, got str 'yes'"),
    (
        "wrong-type-port",
        lambda c: node(1)(c)["ports"].update(control="50004"),
        "nodes[1].ports.control",
        "expected int",
    ),
    ("duplicate-node-name", lambda c: node(2)(c).update(name="ffn0"), "nodes[2].name", "duplicate node name 'ffn0'"),
    (
        "duplicate-port",
        lambda c: node(1)(c)["ports"].update(data=50001),
        "nodes[1].ports.data",
        "port 50001 on 127.0.0.1 is already used by attn0.ports.control",
    ),
    (
        "port-out-of-range",
        lambda c: node(0)(c)["ports"].update(http=70000),
        "nodes[0].ports.http",
        "port 70000 outside 1..65535",
    ),
    (
        "bad-role",
        lambda c: node(0)(c).update(role="router"),
        "nodes[0].role",
        "must be one of attention, ffn, got 'router'",
    ),
    (
        "bad-device",
        lambda c: node(1)(c).update(device="tpu:0"),
        "nodes[1].device",
        "expected cpu, cuda[:N] or npu[:N], got 'tpu:0'",
    ),
    ("bad-device-index", lambda c: node(1)(c).update(device="cuda:x"), "nodes[1].device", "got 'cuda:x'"),
    (
        "shared-gpu",
        devices("cuda:0", "cuda:0"),
        "nodes[1].device",
        "ffn0 and attn0 (nodes[0].device 'cuda:0') both use cuda:0 on 127.0.0.1: give each node its own device",
    ),
    (
        "shared-gpu-other-roles",
        devices("cuda:0", "cuda:1", "cuda:1"),
        "nodes[2].device",
        "ffn1 and ffn0 (nodes[1].device 'cuda:1') both use cuda:1 on 127.0.0.1",
    ),
    (
        "shared-npu-no-index-is-0",
        devices(None, "npu", "npu:0"),
        "nodes[2].device",
        "ffn1 and ffn0 (nodes[1].device 'npu') both use npu:0 on 127.0.0.1",
    ),
    (
        "shared-npu-even-when-allowed",
        lambda c: (c["cluster"].update(share_devices=True), devices("npu:0", "npu:0")(c)),
        "nodes[1].device",
        "both use npu:0 on 127.0.0.1: give each node its own device (NCCL and HCCL take one process per device; "
        "TP rank r of an attention node takes the node's device index + r); cluster.share_devices lets CUDA nodes "
        "share one, not NPU nodes",
    ),
    (
        "attention-without-http",
        lambda c: node(0)(c)["ports"].pop("http"),
        "nodes[0].ports.http",
        "attention nodes need an http port",
    ),
    (
        "ffn-with-http",
        lambda c: node(1)(c)["ports"].update(http=50010),
        "nodes[1].ports.http",
        "FFN nodes serve no API",
    ),
    ("node-without-host", lambda c: node(1)(c).pop("host"), "nodes[1].host", "required key is missing"),
    ("missing-model-path", lambda c: c["model"].pop("path"), "model.path", "required key is missing"),
    ("missing-nodes", lambda c: c.pop("nodes"), "nodes", "required key is missing"),
    ("bad-dtype", lambda c: c["model"].update(dtype="int8"), "model.dtype", "expected auto, float32, bfloat16"),
    (
        "bad-kv-cache-bytes",
        lambda c: c.update(engine={"kv_cache_bytes": "lots"}),
        "engine.kv_cache_bytes",
        "expected a byte count like 256MiB, got 'lots'",
    ),
    (
        "negative-shutdown-timeout",
        lambda c: c.update(engine={"shutdown_timeout": -1}),
        "engine.shutdown_timeout",
        "must be >= 0, got -1",
    ),
    (
        "placement-without-ffn-nodes",
        lambda c: c.update(nodes=c["nodes"][:1], layout={"placement": {"ffn0": "0-15"}}),
        "layout.placement",
        "must name every FFN node exactly",
    ),
    ("no-attention-node", lambda c: c.update(nodes=c["nodes"][1:]), "nodes", "needs at least one attention node"),
    (
        "placement-unknown-node",
        layout(placement={"ffn0": "0-7", "ffn9": "8-15"}),
        "layout.placement",
        "must name every FFN node exactly (ffn0, ffn1)",
    ),
    (
        "placement-bad-range",
        layout(placement={"ffn0": "0-7", "ffn1": "15-8"}),
        "layout.placement.ffn1",
        "range '15-8' ends before it starts",
    ),
    (
        "placement-not-an-id",
        layout(placement={"ffn0": "0-7", "ffn1": [8, "x"]}),
        "layout.placement.ffn1",
        "'x' is not an expert id or a 'lo-hi' range",
    ),
    ("routing", layout(routing="everywhere"), "layout.routing", "expected attention, ffn, got 'everywhere'"),
    ("zero-experts-not-ffn", layout(zero_experts="attn0"), "layout.zero_experts", "'attn0' is not an FFN node"),
    ("micro-batches", layout(micro_batches=7), "layout.micro_batches", "must be in 0..4 (0: automatic), got 7"),
    (
        "exchange-dtype",
        layout(exchange_dtype="fp4"),
        "layout.exchange_dtype",
        "expected same, fp8, int8, got 'fp4'",
    ),
    (
        "quantization",
        lambda c: c["model"].update(quantization="int4"),
        "model.quantization",
        "expected fp8, w8a8, w8a16, got 'int4'",
    ),
    (
        "unknown-coordinator",
        lambda c: c["cluster"].update(coordinator="boss"),
        "cluster.coordinator",
        "'boss' is not a node",
    ),
    ("invalid-yaml", "model: {path: demo\nnodes: [\n", "", "not valid YAML"),
    ("not-a-mapping", "- just\n- a list\n", "", "the file must be a YAML mapping"),
    ("no-such-file", None, "", "no such file"),
]


@pytest.fixture(scope="module")
def mistake_files(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("mistakes")
    files = {}
    for case_id, mistake, _, _ in MISTAKES:
        path = files[case_id] = tmp / f"{case_id}.yaml"
        if isinstance(mistake, str):
            path.write_text(mistake)
        elif mistake is not None:
            cfg = valid()
            mistake(cfg)
            path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return files


@pytest.fixture(scope="module")
def check_config_runs(mistake_files) -> dict[str, subprocess.CompletedProcess]:
    return afd_many({case_id: ["check-config", str(path)] for case_id, path in mistake_files.items()})


def expected_message(path: Path, key: str, problem: str) -> tuple[str, str]:
    """The message starts with the file and the key path; the problem follows."""
    return (f"{path}: {key}: " if key else f"{path}: "), problem


def test_the_valid_base_is_valid():
    cfg = from_dict(valid())
    assert isinstance(cfg, ClusterConfig) and cfg.topology_name == "1A2F"


@pytest.mark.parametrize("case_id, mistake, key, problem", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_mistake_names_key_and_problem(mistake_files, case_id, mistake, key, problem):
    path = mistake_files[case_id]
    prefix, problem = expected_message(path, key, problem)
    with pytest.raises(ClusterConfigError) as err:
        load(str(path))
    assert str(err.value).startswith(prefix), str(err.value)
    assert problem in str(err.value)


@pytest.mark.parametrize("case_id, mistake, key, problem", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_check_config_rejects_mistake(check_config_runs, mistake_files, case_id, mistake, key, problem):
    r = check_config_runs[case_id]
    prefix, problem = expected_message(mistake_files[case_id], key, problem)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith(f"afd check-config: error: {prefix}"), r.stderr
    assert problem in r.stderr
    assert r.stderr.count("error:") == 1  # one message (the YAML parser's spans lines: where and what)
    assert r.stdout == ""


@pytest.mark.parametrize(
    "edit",
    [
        devices("cuda:0", "cuda:1", "cuda:2"),
        devices("cuda", "cuda:1", "npu"),  # a cuda and an npu index are different devices
        devices("cuda:0", "cuda:0", "cuda:0", hosts=("10.0.0.1", "10.0.0.2", "gpu-host-3")),
        devices("npu:0", "npu:0", hosts=("afd-attention-0.afd-attention", "afd-ffn-0.afd-ffn")),  # pods
        devices("cpu", "cpu", "cpu"),  # CPU nodes share a host freely (and so does the base, all cpu)
        devices(None, "cpu", "cuda:0"),
    ],
    ids=[
        "gpus-of-one-host",
        "default-index-and-types",
        "one-gpu-per-host",
        "one-npu-per-pod",
        "cpus",
        "cpu-beside-gpu",
    ],
)
def test_nodes_on_their_own_devices_are_accepted(edit):
    cfg = valid()
    edit(cfg)
    from_dict(cfg)


def test_cuda_nodes_share_a_device_only_where_the_cluster_says_so():
    """cluster.share_devices (a cluster on one GPU): each node on a shared device gets its own NCCL_HOSTID."""
    cfg = valid()
    devices("cuda:0", "cuda:0", "cuda:1")(cfg)
    cfg["cluster"]["share_devices"] = True
    loaded = from_dict(cfg)
    assert [loaded.shares_device(n.name) for n in loaded.nodes] == [True, True, False]
    devices("cuda:0", "cuda:1", "cuda:2")(cfg)
    assert not any(from_dict(cfg).shares_device(n.name) for n in loaded.nodes)


def test_k8s_rendered_at_any_size_keeps_one_device_per_pod():
    """Every pod is its own host, so the ConfigMap's nodes may all say npu:0 (render.py copies the device)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("afd_k8s_render", DEPLOY / "k8s" / "render.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    for a, f in ((1, 1), (3, 5)):
        (cm,) = [
            d
            for d in render.render(render.load(), a, f)
            if d["kind"] == "ConfigMap" and "cluster.yaml" in d.get("data", {})
        ]
        cfg = from_dict(yaml.safe_load(cm["data"]["cluster.yaml"]), "rendered")
        assert len({(n.host, n.device) for n in cfg.nodes}) == len(cfg.nodes) == a + f


def test_from_dict_rejects_a_non_mapping():
    with pytest.raises(ClusterConfigError, match=r"^<dict>: the file must be a YAML mapping"):
        from_dict(["not", "a", "mapping"])
