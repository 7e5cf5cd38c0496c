"""Observability: the Prometheus scrape config, the Grafana dashboard, and a real Prometheus scraping a
real cluster (skipped where Prometheus is not installed: `.ci/prometheus.sh` installs it). The metrics
behind the dashboard, moving as they should in process, are test_metrics_in_process.py. Grafana itself
cannot be installed here (no Debian package, not on PyPI), so the dashboard is checked by reading its
JSON against the metrics that exist."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from cluster_helpers import ROOT, Cluster, cluster_yaml, free_ports, get, post, skip_unless_ci_installs, wait_for
from metrics_text import samples, total

from afd.cluster.config import from_dict, load
from afd.control import control_pb2 as pb
from afd.model.demo_config import DEMO_CONFIG
from afd.observability import prometheus_config
from afd.observability.attention_metrics import AttentionMetrics
from afd.observability.ffn_metrics import FFNMetrics
from afd.observability.prometheus_config import render

LOCAL_YAML = ROOT / "deploy" / "local.yaml"
COMMITTED = ROOT / "deploy" / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "afd-dashboard.json"
PROMETHEUS_MISSING = "prometheus not installed: run .ci/prometheus.sh or apt-get install prometheus"
PROMTOOL_MISSING = "promtool not installed: run .ci/prometheus.sh or apt-get install prometheus"

# Every metric the issue names, with the role whose nodes export it.
ATTENTION_METRICS = (
    "afd_time_to_first_token_seconds_bucket",
    "afd_inter_token_latency_seconds_bucket",
    "afd_e2e_request_latency_seconds_bucket",
    "afd_request_queue_time_seconds_bucket",
    "afd_num_requests_running",
    "afd_num_requests_waiting",
    "afd_kv_cache_usage_ratio",
    "afd_prompt_tokens_total",
    "afd_generation_tokens_total",
    "afd_request_success_total",
    "afd_step_seconds_bucket",
    "afd_ffn_wait_seconds_bucket",
    "afd_a2f_bytes_total",
    "afd_exchange_bytes_total",
    "afd_cluster_state",
    "afd_engine_dead",
    "afd_micro_batches",
)
FFN_METRICS = (
    "afd_ffn_compute_seconds_bucket",
    "afd_ffn_idle_seconds_bucket",
    "afd_ffn_tokens_total",
    "afd_expert_tokens_total",
    "afd_prefetch_bytes_total",
    "afd_cluster_state",
    "afd_ffn_layer_compute_seconds_total",
    "afd_ffn_layer_idle_seconds_total",
    "afd_zero_expert_tokens_total",
)
# The stat row on top: what each of its panels must query.
STAT_ROW_METRICS = (
    "afd_cluster_state",
    "afd_engine_dead",
    "afd_ffn_wait_seconds_sum",
    "afd_step_seconds_sum",
    "afd_ffn_compute_seconds_sum",
    "afd_ffn_idle_seconds_sum",
    "afd_generation_tokens_total",
    "afd_micro_batches",
)


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


_KEYWORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
    "atan2",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: identifiers that are not functions, aggregations,
    keywords, label names, strings, durations or $variables."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range selectors, $__rate_interval
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][\w:]*", s):
        if s[m.end() :].lstrip().startswith("(") or m.group().lower() in _KEYWORDS:
            continue  # a function or an aggregation
        names.add(m.group())
    return names


def dashboard_exprs(dash: dict) -> list[tuple[str, str]]:
    """(panel title, expr) for every query of every panel, rows' nested panels included."""
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((p.get("title", "?"), t["expr"]))
            walk(p.get("panels", []))

    walk(dash["panels"])
    return out


def exported_sample_names() -> set[str]:
    """Sample names both roles' metrics objects render, as the nodes serve them."""
    attn = AttentionMetrics("a", "m")
    attn.step("decode")  # afd_step_seconds{phase} has a series once a step ran
    ffn = FFNMetrics("f", "m", range(4), num_layers=2)
    ffn.add_expert_tokens([1, 0, 0, 0])
    names = set()
    for m in (attn, ffn):
        m.watch_cluster_state(lambda: pb.ClusterStatus.READY)  # the nodes do; offline engines have no cluster
        names |= set(samples(m.render().decode()))
    return names


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


# ---- the dashboard -----------------------------------------------------------------------------


def test_promql_metric_names():
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le, phase) (rate(afd_x_bucket{a="b", c=~"$d"}[$__rate_interval])))'
    ) == {"afd_x_bucket"}
    assert promql_metric_names("sum(rate(a_total[5m])) by (node) / on(node) b + 1e-3") == {"a_total", "b"}


def test_dashboard_uses_only_exported_metrics():
    dash = json.loads(DASHBOARD.read_text())
    assert 36 <= dash["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    exprs = dashboard_exprs(dash)
    assert len(exprs) >= 14
    exported = exported_sample_names()
    used = set()
    for title, expr in exprs:
        names = promql_metric_names(expr)
        assert names, f"panel {title!r}: no metric in {expr!r}"
        unknown = names - exported
        assert not unknown, f"panel {title!r} queries metrics no node exports: {sorted(unknown)}"
        used |= names
    # The panels the issue asks for: each of these is queried somewhere.
    for name in (
        "afd_request_success_total",
        "afd_time_to_first_token_seconds_bucket",
        "afd_inter_token_latency_seconds_bucket",
        "afd_prompt_tokens_total",
        "afd_generation_tokens_total",
        "afd_num_requests_running",
        "afd_num_requests_waiting",
        "afd_kv_cache_usage_ratio",
        "afd_ffn_wait_seconds_sum",
        "afd_step_seconds_sum",
        "afd_ffn_compute_seconds_sum",
        "afd_ffn_idle_seconds_sum",
        "afd_expert_tokens_total",
        "afd_prefetch_bytes_total",
        "afd_a2f_bytes_total",
        "afd_e2e_request_latency_seconds_bucket",
        "afd_request_queue_time_seconds_bucket",
        "afd_cluster_state",
        "afd_engine_dead",
        "afd_micro_batches",
        "afd_ffn_layer_compute_seconds_total",
        "afd_ffn_layer_idle_seconds_total",
        "afd_zero_expert_tokens_total",
    ):
        assert name in used, f"no dashboard panel queries {name}"
    ids = [p["id"] for p in all_panels(dash)]
    assert len(ids) == len(set(ids))


def all_panels(dash: dict) -> list[dict]:
    """Every panel, rows' nested panels included."""
    out = []

    def walk(panels):
        for p in panels:
            out.append(p)
            walk(p.get("panels", []))

    walk(dash["panels"])
    return out


def _exprs(panel: dict) -> list[str]:
    return [t["expr"] for t in panel.get("targets", []) if t.get("expr")]


def test_every_panel_has_a_title_a_unit_and_a_query():
    for p in all_panels(json.loads(DASHBOARD.read_text())):
        assert p.get("title"), f"panel {p['id']} has no title"
        if p["type"] == "row":
            continue
        assert p["fieldConfig"]["defaults"].get("unit"), f"panel {p['title']!r} has no unit"
        assert _exprs(p), f"panel {p['title']!r} has no query"


def test_the_stat_row_comes_first():
    panels = sorted(json.loads(DASHBOARD.read_text())["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    assert panels[0]["type"] == "row" and panels[0]["gridPos"]["y"] == 0, "the dashboard starts with a row header"
    stats = [p for p in panels if p["type"] == "stat"]
    others = [p for p in panels[1:] if p["type"] != "stat"]
    assert stats and max(p["gridPos"]["y"] for p in stats) < min(p["gridPos"]["y"] for p in others), (
        "the stat panels are the first row, above everything else"
    )
    assert max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in stats) <= 8, "the stat row is above the fold"
    queried = {n for p in stats for e in _exprs(p) for n in promql_metric_names(e)}
    assert set(STAT_ROW_METRICS) <= queried, sorted(set(STAT_ROW_METRICS) - queried)
    by_metric = {n: p for p in stats for e in _exprs(p) for n in promql_metric_names(e)}
    assert "lower is better" in by_metric["afd_ffn_wait_seconds_sum"]["title"]
    state = by_metric["afd_cluster_state"]["fieldConfig"]["defaults"]["mappings"]
    shown = {int(v): o["text"] for m in state for v, o in m["options"].items()}
    assert shown == {v: k for k, v in pb.ClusterStatus.State.items()}, "every cluster state has its name"


_TOKEN_RATE = re.compile(r"sum( by \(\w+\))? \(rate\(afd_\w*tokens_total\{[^}]*\}\[\$__rate_interval\]\)\)")


def test_units_say_what_the_numbers_are():
    """Token rates in tok/s, durations in seconds, shares (and seconds per second) as percentunit."""
    for p in all_panels(json.loads(DASHBOARD.read_text())):
        if p["type"] == "row":
            continue
        unit, exprs, title = p["fieldConfig"]["defaults"]["unit"], _exprs(p), p["title"]
        if all(_TOKEN_RATE.fullmatch(e) for e in exprs):
            assert unit == "suffix: tok/s", f"{title!r}: a token rate in {unit}"
        if any("histogram_quantile" in e and "_seconds_bucket" in e for e in exprs):
            assert unit == "s", f"{title!r}: a duration in {unit}"
        if "share" in title.lower() or any(
            re.search(r"rate\(afd_\w*seconds_(sum|total)\b", e) and "_count" not in e for e in exprs
        ):
            assert unit == "percentunit", f"{title!r}: a share in {unit}"


def test_expert_and_layer_panels():
    panels = {p["title"]: p for p in all_panels(json.loads(DASHBOARD.read_text()))}
    heat = [p for p in panels.values() if p["type"] == "heatmap"]
    assert len(heat) == 1 and "afd_expert_tokens_total" in _exprs(heat[0])[0] and "by (expert)" in _exprs(heat[0])[0]
    # Grafana's `heatmap` format would de-accumulate the series as histogram buckets: per-expert rates
    # are plain series, one row each.
    assert all(t.get("format", "time_series") == "time_series" for t in heat[0]["targets"])
    assert heat[0]["options"]["calculate"] is False
    imbalance = next(p for t, p in panels.items() if "imbalance" in t.lower())
    assert re.fullmatch(r"max\((.+)\) / avg\(\1\)", _exprs(imbalance)[0]), "max / mean of the per-expert rate"
    zero = next(p for t, p in panels.items() if "zero-compute" in t.lower())
    assert "afd_zero_expert_tokens_total" in _exprs(zero)[0] and "afd_expert_tokens_total" in _exprs(zero)[0]
    layer = next(p for t, p in panels.items() if "per layer" in t.lower())
    for name in ("afd_ffn_layer_compute_seconds_total", "afd_ffn_layer_idle_seconds_total"):
        assert any(name in e and "by (layer)" in e for e in _exprs(layer)), name


# ---- a real Prometheus scraping a real cluster ---------------------------------------------------


def _api(base: str, path: str, **params) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(params, doseq=True)}" if params else base + path
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


def _query(base: str, expr: str) -> list[dict]:
    return _api(base, "/api/v1/query", query=expr)["result"]


def _stream_usage(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    usage = None
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                usage = chunk.get("usage") or usage
    assert usage is not None, "stream_options.include_usage sent no usage chunk"
    return usage


def _complete(url: str, i: int) -> int:
    """One completion request; returns its usage.completion_tokens."""
    body = {"prompt": f"Metrics request number {i}:", "max_tokens": 4 + i % 5, "temperature": 0}
    if i % 2:
        return _stream_usage(url, {**body, "stream": True, "stream_options": {"include_usage": True}})[
            "completion_tokens"
        ]
    code, resp = post(url, "/v1/completions", body)
    assert code == 200, resp
    return resp["usage"]["completion_tokens"]


def _fill(expr: str) -> str:
    return expr.replace("$__rate_interval", "1m").replace("$model_name", ".*").replace("$node", ".*")


def _scrape_at(url: str) -> tuple[float, dict]:
    """(when, samples) of a node's /metrics; `when` is the middle of the request."""
    t0 = time.monotonic()
    code, body = get(url, "/metrics")
    assert code == 200
    return (t0 + time.monotonic()) / 2, samples(body.decode())


def _longest_span(before: dict, after: dict, histogram: str) -> float:
    """An upper bound of the longest observation of `histogram` between two scrapes: the smallest bucket bound
    holding every observation made between them (the buckets count cumulatively)."""
    old, new = before.get(f"{histogram}_bucket", {}), after.get(f"{histogram}_bucket", {})
    gained = {dict(k)["le"]: v - old.get(k, 0) for k, v in new.items()}
    bounds = sorted((float(le), n) for le, n in gained.items())  # +Inf sorts last
    return next(le for le, n in bounds if n == bounds[-1][1])


def _check_node_metrics(attn_url: str, ffn_url: str, ffn_before: tuple[float, dict]) -> None:
    """The new metrics of a live 1A1F demo cluster (2 micro-batches), read from the nodes themselves
    once the load is over."""
    t1, ffn = _scrape_at(ffn_url)
    _, attn = _scrape_at(attn_url)
    t0, before = ffn_before
    busy = ["afd_ffn_compute_seconds_sum", "afd_ffn_idle_seconds_sum"]
    covered = sum(total(ffn, n) - total(before, n) for n in busy) / (t1 - t0)
    # A span is accounted when it ends: one open at the first scrape counts whole (some of it before the
    # window), one open at the last not at all. So the sum is the window's within the longest span in it
    # (an idle one: computes are short), read from the idle histogram's buckets; and 10 % for the rest.
    slack = _longest_span(before, ffn, "afd_ffn_idle_seconds") / (t1 - t0)
    assert 0.9 - slack <= covered <= 1.1 + slack, f"FFN compute + idle covered {covered:.0%} of the wall time"
    per_layer = {dict(k)["layer"]: v for k, v in ffn["afd_ffn_layer_compute_seconds_total"].items()}
    assert sorted(per_layer, key=int) == [str(i) for i in range(DEMO_CONFIG["num_layers"])]
    assert all(v > 0 for v in per_layer.values())
    assert sum(per_layer.values()) == pytest.approx(total(ffn, "afd_ffn_compute_seconds_sum"))
    assert len(ffn["afd_ffn_layer_idle_seconds_total"]) == DEMO_CONFIG["num_layers"]
    # Every routing slot of every token and layer went to a routed expert or an identity one.
    zero = total(ffn, "afd_zero_expert_tokens_total")
    assert zero > 0
    slots = total(ffn, "afd_ffn_tokens_total") * DEMO_CONFIG["moe_topk"]
    assert zero + total(ffn, "afd_expert_tokens_total") == slots
    for got in (attn, ffn):
        assert total(got, "afd_cluster_state") == pb.ClusterStatus.READY
    assert total(attn, "afd_micro_batches") == 2
    assert total(attn, "afd_engine_dead") == 0


@pytest.mark.multiprocess
def test_prometheus_scrapes_a_cluster(tmp_path):
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        skip_unless_ci_installs(PROMETHEUS_MISSING)
    # Two fixed micro-batches: the runner's choice, which afd_micro_batches must show.
    path = cluster_yaml(tmp_path, "demo", name="obs", layout={"micro_batches": 2})
    cfg = load(str(path))
    prom_yml = tmp_path / "prometheus.yml"
    prom_yml.write_text(render(cfg, scrape_interval="1s"))
    (port,) = free_ports(1)
    base = f"http://127.0.0.1:{port}"
    prom_log = tmp_path / "prometheus.log"
    cluster = Cluster(path)
    prom = None
    try:
        cluster.start_all()
        with open(prom_log, "w") as fh:
            prom = subprocess.Popen(
                [
                    prometheus,
                    f"--config.file={prom_yml}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        cluster.wait_ready()
        url = cluster.url()
        ffn_url = f"http://127.0.0.1:{cluster.node('ffn0')['ports']['metrics']}"
        ffn_before = _scrape_at(ffn_url)
        with ThreadPoolExecutor(4) as pool:
            completion_tokens = sum(pool.map(lambda i: _complete(url, i), range(10)))
        assert completion_tokens > 0

        def targets_up():
            assert prom.poll() is None, f"prometheus exited:\n{prom_log.read_text()[-4000:]}"
            active = _api(base, "/api/v1/targets", state="active")["activeTargets"]
            return active if len(active) == len(cfg.nodes) and all(t["health"] == "up" for t in active) else None

        active = wait_for("every target up", targets_up, 30, prom_log)
        assert {(t["labels"]["job"], t["labels"]["role"], t["labels"]["node"]) for t in active} == {
            ("afd-attention", "attention", "attn0"),
            ("afd-ffn", "ffn", "ffn0"),
        }
        assert {r["metric"]["node"] for r in _query(base, "up == 1")} == {"attn0", "ffn0"}

        # Wait for a scrape that saw every request: the counter equals the tokens the API reported.
        def generated():
            res = _query(base, "sum(afd_generation_tokens_total)")
            return res and int(float(res[0]["value"][1])) == completion_tokens

        wait_for(f"sum(afd_generation_tokens_total) == {completion_tokens}", generated, 20, prom_log)
        res = _query(base, "sum(afd_generation_tokens_total)")
        assert int(float(res[0]["value"][1])) == completion_tokens

        for role, names in (("attention", ATTENTION_METRICS), ("ffn", FFN_METRICS)):
            node = cfg.attention_nodes[0].name if role == "attention" else cfg.ffn_nodes[0].name
            for name in names:
                series = _query(base, f'{name}{{job="afd-{role}"}}')
                assert series, f"{name}: no series scraped from the {role} node"
                for s in series:
                    labels = s["metric"]
                    assert labels.get("role") == role and labels.get("node") == node, labels
                    assert labels.get("model_name"), labels
                    assert not [k for k in labels if k.startswith("exported_")], labels

        # Every dashboard query parses in Prometheus, and every metric it names has series.
        dash = json.loads(DASHBOARD.read_text())
        for title, expr in dashboard_exprs(dash):
            _query(base, _fill(expr))  # status success: valid PromQL
            for name in promql_metric_names(expr):
                assert _query(base, name), f"panel {title!r}: {name} has no series in Prometheus"
        for var in dash["templating"]["list"]:
            if var["type"] != "query":
                continue
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q)
            assert m, f"variable {var['name']}: unexpected query {q!r}"
            values = _api(base, f"/api/v1/label/{m.group(2)}/values", **{"match[]": _fill(m.group(1))})
            assert values, f"variable {var['name']}: {q} has no values"
        assert set(_api(base, "/api/v1/label/node/values", **{"match[]": '{__name__=~"afd_.+"}'})) == {"attn0", "ffn0"}
        tokens = _query(base, "sum(afd_ffn_tokens_total)")
        assert float(tokens[0]["value"][1]) > 0
        experts = _query(base, "sum(afd_expert_tokens_total)")
        assert float(experts[0]["value"][1]) > 0
        _check_node_metrics(url, ffn_url, ffn_before)
    finally:
        if prom is not None and prom.poll() is None:
            prom.terminate()
            try:
                prom.wait(10)
            except subprocess.TimeoutExpired:
                prom.kill()
                prom.wait()
        cluster.stop()
