"""Observability: the Prometheus scrape config `afd prometheus-config` renders from a cluster YAML, and
the committed deploy/prometheus.yml kept current (promtool checks both where it is installed). The Grafana
dashboard is test_observability_dashboard.py; a real Prometheus scraping a real cluster (skipped where
Prometheus is not installed: `.ci/prometheus.sh` installs it) is test_observability_prometheus.py. The metrics
behind the dashboard, moving as they should in process, are test_metrics_in_process.py.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from cluster_helpers import ROOT, cluster_yaml, skip_unless_ci_installs

from afd.config.loader import from_dict, load
from afd.entrypoints import prometheus_config
from afd.entrypoints.prometheus_config import render

LOCAL_YAML = ROOT / "deploy" / "local.yaml"
COMMITTED = ROOT / "deploy" / "prometheus.yml"
PROMTOOL_MISSING = "promtool not installed: run .ci/prometheus.sh or apt-get install prometheus"


# ---- helpers ------------------------------------------------------------------------------------


def _local_cfg(monkeypatch):
    monkeypatch.chdir(ROOT)  # the header names the YAML as given: `afd prometheus-config deploy/local.yaml`
    return load("deploy/local.yaml")


def _scrape_targets(doc: dict) -> dict[str, list[tuple[str, dict]]]:
    """job name -> [(target, labels)] of a parsed Prometheus config."""
    out = {}
    for job in doc["scrape_configs"]:
        out[job["job_name"]] = [(t, sc.get("labels", {})) for sc in job["static_configs"] for t in sc["targets"]]
    return out


def _promtool_check(path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        skip_unless_ci_installs(PROMTOOL_MISSING)
    r = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"promtool check config {path}:\n{r.stdout}{r.stderr}"


# ---- the scrape config --------------------------------------------------------------------------


def test_render_local_yaml(monkeypatch):
    text = render(_local_cfg(monkeypatch))
    doc = yaml.safe_load(text)
    assert doc["global"]["scrape_interval"] == "5s"
    assert _scrape_targets(doc) == {
        "afd-attention": [("127.0.0.1:8000", {"role": "attention", "node": "attn0"})],
        "afd-ffn": [("127.0.0.1:9151", {"role": "ffn", "node": "ffn0"})],
    }
    assert all(job["metrics_path"] == "/metrics" for job in doc["scrape_configs"])
    assert all(job["honor_labels"] is True for job in doc["scrape_configs"])  # no exported_node / exported_role
    assert text.startswith("# ") and "afd prometheus-config deploy/local.yaml" in text.splitlines()[1]


def test_committed_prometheus_yml_is_current(monkeypatch):
    expected = render(_local_cfg(monkeypatch))
    assert COMMITTED.read_text() == expected, (
        "deploy/prometheus.yml is stale: regenerate it with "
        "`afd prometheus-config deploy/local.yaml --output deploy/prometheus.yml`"
    )


def test_render_2a1f(tmp_path):
    path = cluster_yaml(tmp_path, "demo", attention=2, ffn=1, name="two")
    cfg = load(str(path))
    text = render(cfg, scrape_interval="1s")
    doc = yaml.safe_load(text)
    assert doc["global"]["scrape_interval"] == "1s"
    want = {
        "afd-attention": [
            (f"{n.host}:{n.ports.http}", {"role": "attention", "node": n.name}) for n in cfg.attention_nodes
        ],
        "afd-ffn": [(f"{n.host}:{n.ports.metrics}", {"role": "ffn", "node": n.name}) for n in cfg.ffn_nodes],
    }
    assert _scrape_targets(doc) == want
    assert [labels["node"] for _, labels in want["afd-attention"]] == ["attn0", "attn1"]


def test_promtool_accepts_generated_config(tmp_path):
    out = tmp_path / "prometheus.yml"
    out.write_text(render(load(str(cluster_yaml(tmp_path, "demo", attention=2, ffn=2, name="p"))), "1s"))
    _promtool_check(out)


def test_ffn_node_without_metrics_port_is_skipped_with_a_comment():
    raw = {
        "model": {"path": "demo"},
        "nodes": [
            {"name": "a", "role": "attention", "host": "10.0.0.1", "ports": {"control": 1, "data": 2, "http": 3}},
            {"name": "f0", "role": "ffn", "host": "10.0.0.2", "ports": {"control": 1, "data": 2, "metrics": 9}},
            {"name": "f1", "role": "ffn", "host": "10.0.0.3", "ports": {"control": 1, "data": 2}},
        ],
    }
    text = render(from_dict(raw))
    assert "# f1: skipped, no ports.metrics" in text
    targets = _scrape_targets(yaml.safe_load(text))
    assert targets["afd-ffn"] == [("10.0.0.2:9", {"role": "ffn", "node": "f0"})]
    raw["nodes"].pop(1)
    text = render(from_dict(raw))  # no FFN target at all: still a valid config
    assert _scrape_targets(yaml.safe_load(text))["afd-ffn"] == []


def test_bad_scrape_interval(monkeypatch):
    with pytest.raises(ValueError, match="scrape-interval"):
        render(_local_cfg(monkeypatch), scrape_interval="5 seconds")


def test_cli_stdout_and_output(monkeypatch, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="afd")
    prometheus_config.add_parser(parser.add_subparsers(dest="command"))
    monkeypatch.chdir(ROOT)
    args = parser.parse_args(["prometheus-config", "deploy/local.yaml"])
    assert args.func(args) == 0
    assert capsys.readouterr().out == COMMITTED.read_text()
    out = tmp_path / "p.yml"
    args = parser.parse_args(
        ["prometheus-config", "deploy/local.yaml", "--output", str(out), "--scrape-interval", "15s"]
    )
    assert args.func(args) == 0
    assert yaml.safe_load(out.read_text())["global"]["scrape_interval"] == "15s"


def test_promtool_accepts_committed_config():
    _promtool_check(COMMITTED)
