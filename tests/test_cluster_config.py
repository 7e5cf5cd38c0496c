"""The cluster YAML: the examples in deploy/ validate, every kind of mistake is rejected with its key path,
and `afd launch --print-commands` prints the node commands. (The Kubernetes manifests: test_k8s_manifests.py.)

Fast: the only processes are `afd` CLI calls, run a few at a time.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from afd.cluster.config import ClusterConfig, ClusterConfigError, from_dict, load
from afd.model.demo import DEMO_CONFIG

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
EXAMPLES = sorted(DEPLOY.glob("*.yaml"))
TOPOLOGY = {"local.yaml": "1A1F", "2a1f.yaml": "2A1F", "1a2f.yaml": "1A2F", "cuda-1a1f.yaml": "1A1F"}


def afd(*argv: str) -> subprocess.CompletedProcess:
    """`afd ARGV...` as a user runs it (python -m, so that it is this checkout's afd)."""
    return subprocess.run(
        [sys.executable, "-m", "afd.cli", *argv], capture_output=True, text=True, cwd=ROOT, timeout=180
    )


def afd_many(argvs: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess]:
    """`afd ARGV...` for each key: afd.cli.main called in turn inside one process, each call's exit code
    and output captured (a process per call spent a second each importing torch). An exception that
    main() lets through fails the whole process, so it cannot pass unnoticed."""
    r = subprocess.run(
        [sys.executable, "-c", _MAIN_MANY, json.dumps(argvs)], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return {
        k: subprocess.CompletedProcess(argvs[k], code, out, err)
        for k, (code, out, err) in json.loads(r.stdout.splitlines()[-1]).items()
    }


_MAIN_MANY = """
import contextlib, io, json, sys
from afd.cli import main
results = {}
for key, argv in json.loads(sys.argv[1]).items():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    results[key] = [code, out.getvalue(), err.getvalue()]
print(json.dumps(results))
"""


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


# ---- afd launch --print-commands ----------------------------------------------------------------


def _token_prefix(path: str = "deploy/2a1f.yaml") -> str:
    """What printed commands of a one-host cluster start with: the cluster's 0600 token file, by name."""
    import os

    from afd.cluster.token import TOKEN_ENV, token_file

    if os.environ.get(TOKEN_ENV):
        return ""
    cfg = load(str(ROOT / path))
    return f"AFD_CLUSTER_TOKEN_FILE={token_file(cfg.cluster.name, cfg.coordinator.ports.control)} "


def _node_argv(line: str) -> list[str]:
    """A printed command's program and arguments, without the environment it sets."""
    words = shlex.split(line, comments=True)
    return words[1:] if words[0].startswith("AFD_CLUSTER_TOKEN_FILE=") else words


def test_print_commands_one_per_node():
    r = afd("launch", "deploy/2a1f.yaml", "--print-commands")
    assert r.returncode == 0, r.stderr
    t = _token_prefix()
    assert r.stdout.splitlines() == [
        f"{t}afd-attention --config deploy/2a1f.yaml --node attn0  # on 127.0.0.1",
        f"{t}afd-attention --config deploy/2a1f.yaml --node attn1  # on 127.0.0.1",
        f"{t}afd-ffn --config deploy/2a1f.yaml --node ffn0  # on 127.0.0.1",
    ]


def test_commands_that_only_read_a_yaml_never_import_torch(tmp_path):
    """`afd --help` and `afd launch --print-commands` answer in a fraction of a second (torch's import alone
    takes seconds): every subcommand registers itself, so none may import torch at module level. `afd serve`
    decides its device (`auto`) and writes its YAML before its nodes start, without torch too: its node
    processes then import torch at once, instead of after it. A bad flag, and CUDA asked of a CPU-only build
    of torch, are refused before the import as well."""
    from afd.backend.devices import _cpu_only_torch

    ids = tmp_path / "p.json"
    ids.write_text("[[1, 2, 3]]")
    cases = [
        (["launch", "deploy/2a1f.yaml", "--print-commands"], 0),
        (["serve", "demo", "--print-config"], 0),
        (
            [
                "generate",
                "--model",
                "demo",
                "--prompt-ids",
                "x.json",
                "--max-tokens",
                "2",
                "--colocated",
                "--ffn-nodes",
                "1",
            ],
            2,
        ),
    ]
    if _cpu_only_torch():
        cases += [
            (["serve", "demo", "--device", "cuda"], 2),
            (["generate", "--model", "demo", "--prompt-ids", str(ids), "--max-tokens", "2", "--device", "cuda"], 2),
        ]
    for argv, want in cases:
        code = (
            f"import sys; from afd.cli import main; rc = main({argv!r}); "
            f"assert rc == {want} and 'torch' not in sys.modules, "
            "(rc, sorted(m for m in sys.modules if 'torch' in m)[:5])"
        )
        r = subprocess.run([sys.executable, "-c", code], timeout=120, cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, (argv, r.stderr)


def test_the_ascend_example_shows_what_print_commands_prints():
    r = afd("launch", "deploy/ascend-multihost.yaml", "--print-commands")
    assert r.returncode == 0, r.stderr
    comment = (ROOT / "deploy/ascend-multihost.yaml").read_text()
    for line in r.stdout.splitlines():
        assert f"#     {line}\n" in comment


def test_print_commands_with_overrides():
    """--model goes to every node, --port only to the first attention node."""
    r = afd("launch", "deploy/2a1f.yaml", "--print-commands", "--model", "/ckpt/my model", "--port", "8123")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    t = _token_prefix()
    assert lines == [
        f"{t}afd-attention --config deploy/2a1f.yaml --node attn0 --port 8123 --model '/ckpt/my model'  # on 127.0.0.1",
        f"{t}afd-attention --config deploy/2a1f.yaml --node attn1 --model '/ckpt/my model'  # on 127.0.0.1",
        f"{t}afd-ffn --config deploy/2a1f.yaml --node ffn0 --model '/ckpt/my model'  # on 127.0.0.1",
    ]
    # and the node commands accept exactly these flags
    from attention_node.main import build_server_parser
    from ffn_node.main import build_parser as build_ffn_parser

    parsers = {"afd-attention": build_server_parser(), "afd-ffn": build_ffn_parser()}
    for line in lines:
        prog, *argv = _node_argv(line)
        args = parsers[prog].parse_args(argv)
        assert (args.config, args.model) == ("deploy/2a1f.yaml", "/ckpt/my model")
        assert getattr(args, "port", None) == (8123 if args.node == "attn0" else None)


def test_print_commands_pass_vllm_flags_to_the_nodes_that_take_them():
    """--dtype and --served-model-name reach every node; the engine's flags only attention nodes; the API
    key never a command line (others can read those in `ps`)."""
    r = afd(
        "launch",
        "deploy/2a1f.yaml",
        "--print-commands",
        "--dtype",
        "bfloat16",
        "--served-model-name",
        "m",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
        "--seed",
        "7",
        "--chat-template",
        "t.jinja",
        "--host",
        "0.0.0.0",
        "--api-key",
        "SECRET",
    )
    assert r.returncode == 0, r.stderr
    assert "SECRET" not in r.stdout
    from attention_node.main import build_server_parser
    from ffn_node.main import build_parser as build_ffn_parser

    parsers = {"afd-attention": build_server_parser(), "afd-ffn": build_ffn_parser()}
    for line in r.stdout.splitlines():
        prog, *argv = _node_argv(line)
        args = parsers[prog].parse_args(argv)
        assert (args.dtype, args.served_model_name) == ("bfloat16", "m")
        if prog == "afd-attention":
            assert (args.max_model_len, args.max_num_seqs, args.seed, args.chat_template, args.host) == (
                512,
                8,
                7,
                "t.jinja",
                "0.0.0.0",
            )


@pytest.mark.parametrize(
    "host,insecure,token,refused",
    [
        ("127.0.0.1", False, None, False),
        ("localhost", False, None, False),
        ("::1", False, None, False),
        ("192.0.2.7", False, None, True),
        ("attn-0.afd.svc", False, None, True),
        ("192.0.2.7", True, None, False),
        ("192.0.2.7", False, "s3cret", False),
    ],
)
def test_reachable_host_without_token_is_refused_unless_insecure(monkeypatch, host, insecure, token, refused):
    from afd.node.args import _insecure_start

    monkeypatch.delenv("AFD_CLUSTER_TOKEN", raising=False)
    if token:
        monkeypatch.setenv("AFD_CLUSTER_TOKEN", token)
    cfg = from_dict(
        {
            "cluster": {"insecure": insecure},
            "model": {"path": "demo"},
            "nodes": [
                {"name": "a0", "role": "attention", "host": host, "ports": {"control": 1, "data": 2, "http": 3}},
                {"name": "f0", "role": "ffn", "host": host, "ports": {"control": 4, "data": 5}},
            ],
        }
    )
    err = _insecure_start(cfg, "a0")
    assert (err is not None) == refused
    if refused:
        assert "AFD_CLUSTER_TOKEN is not set" in err and "cluster.insecure: true" in err


def test_a_cluster_without_ffn_nodes_is_colocated():
    """No FFN nodes: each attention node (every TP rank of it) holds every expert itself."""
    cfg = from_dict(
        {
            "model": {"path": "demo"},
            "nodes": [
                {
                    "name": "attn0",
                    "role": "attention",
                    "host": "127.0.0.1",
                    "ports": {"control": 1, "data": 2, "http": 3},
                }
            ],
        }
    )
    assert cfg.colocated and cfg.topology_name == "1A0F"
