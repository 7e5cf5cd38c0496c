"""Graph mode's settings: the cluster YAML's keys (checked), the flags that write them, the metric."""

from __future__ import annotations

import pytest
import yaml
from metrics_text import total

from afd.cluster.local_config import local_job
from afd.config.loader import from_dict
from afd.config.schema import ClusterConfigError
from afd.config.sections import GRAPH_BATCH_SIZES
from afd.engine.graph import GraphSettings, settings_of
from afd.entrypoints.cli import main

NODES = [{"name": "a", "role": "attention", "host": "h", "ports": {"control": 1, "data": 2, "http": 3}}]


def _cfg(**sections):
    return from_dict({"model": {"path": "demo"}, "nodes": NODES, **sections})


def test_yaml_keys_and_their_checks():
    assert settings_of(_cfg()) == GraphSettings(None, GRAPH_BATCH_SIZES, None)  # unset: the backend's default
    cfg = _cfg(layout={"graph_mode": "compile"}, engine={"graph_batch_sizes": [8, 2, 2], "compile_cache_dir": "/c"})
    assert settings_of(cfg) == GraphSettings("compile", (2, 8), "/c")
    for sections, where in (
        ({"layout": {"graph_mode": "jit"}}, "layout.graph_mode"),
        ({"engine": {"graph_batch_sizes": [0, 4]}}, "engine.graph_batch_sizes"),
        ({"engine": {"graph_batch_sizes": []}}, "engine.graph_batch_sizes"),
        ({"engine": {"graph_batch_sizes": 4}}, "engine.graph_batch_sizes"),
        ({"engine": {"compile_cache_dir": 3}}, "engine.compile_cache_dir"),
    ):
        with pytest.raises(ClusterConfigError, match=where):
            _cfg(**sections)


def test_the_flags_write_the_yaml(capsys):
    doc = local_job("demo", graph_mode="compile", graph_batch_sizes=(4,), compile_cache_dir="/c").to_dict()
    assert doc["layout"]["graph_mode"] == "compile"
    assert doc["engine"]["graph_batch_sizes"] == [4] and doc["engine"]["compile_cache_dir"] == "/c"
    assert "graph_mode" not in local_job("demo").to_dict().get("layout", {})
    assert main(["serve", "demo", "--graph-mode", "compile", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["layout"]["graph_mode"] == "compile"
    assert main(["serve", "demo", "--colocated", "--graph-mode", "eager", "--print-config"]) == 0
    assert "--graph-mode eager" in capsys.readouterr().out  # the colocated server's own flag
    from attention_node.colocated import build_parser

    assert build_parser().parse_args(["--model", "demo", "--graph-mode", "compile"]).graph_mode == "compile"
    with pytest.raises(SystemExit):
        main(["generate", "--model", "demo", "--prompt-ids", "p.json", "--max-tokens", "1", "--graph-mode", "jit"])


def test_launch_passes_the_mode_to_every_node(capsys, tmp_path):
    """`afd launch FILE --graph-mode compile` overrides the YAML on every node's command line (each node reads
    one configuration; FFN nodes run no graphs), and a node command applies its --graph-mode over the YAML."""
    from afd.node.args import load_cluster_args
    from attention_node.main import build_server_parser

    path = str(tmp_path / "c.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(local_job("demo", 1, 1).to_dict(), f)
    assert main(["launch", path, "--graph-mode", "compile", "--print-commands"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all("--graph-mode compile" in line for line in lines)
    args = build_server_parser().parse_args(["--config", path, "--node", "attn0", "--graph-mode", "compile"])
    assert load_cluster_args(args, "attention").layout.graph_mode == "compile"
    args = build_server_parser().parse_args(["--config", path, "--node", "attn0"])
    assert load_cluster_args(args, "attention").layout.graph_mode is None  # the YAML's: unset


def test_afd_graph_steps_metric():
    from afd.observability.attention_metrics import AttentionMetrics

    class Half:
        steps = {"graph": 3, "eager": 1}

    m = AttentionMetrics("attn0", "demo")
    m.watch_graph(object())  # not in graph mode: no metric
    assert "afd_graph_steps" not in m.render().decode()
    m.watch_graph(Half())
    body = m.render().decode()
    assert total(body, "afd_graph_steps_total", mode="graph") == 3
    assert total(body, "afd_graph_steps_total", mode="eager") == 1
