"""`afd launch --print-commands` and what a node checks of the YAML as it starts: one command per node, with
the cluster token file, the overrides and the vLLM flags passed to the nodes that take them; the commands that
only read a YAML never import torch; a node on a reachable host without a cluster token is refused unless
cluster.insecure; a cluster without FFN nodes is colocated.

Fast: the only processes are `afd` CLI calls.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest
from cluster_config_helpers import ROOT, afd

from afd.config.loader import from_dict, load

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
            f"import sys; from afd.entrypoints.cli import main; rc = main({argv!r}); "
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
