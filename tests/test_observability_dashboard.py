"""Observability: the Grafana dashboard (deploy/grafana/afd-dashboard.json). Grafana itself cannot be
installed here (no Debian package, not on PyPI), so the dashboard is checked by reading its JSON: every query
parses to metrics the nodes export, every panel has a title, a unit and a query, and the stat row, the unit
choices and the expert and layer panels are as the issue asks.
"""

from __future__ import annotations

import json
import re

from dashboard_helpers import DASHBOARD, dashboard_exprs, promql_metric_names
from metrics_text import samples

from afd.control import control_pb2 as pb
from afd.observability.attention_metrics import AttentionMetrics
from afd.observability.ffn_metrics import FFNMetrics

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
