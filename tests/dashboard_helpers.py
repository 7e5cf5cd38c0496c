"""Reading the Grafana dashboard's queries, for test_observability_dashboard.py and
test_observability_prometheus.py: where the dashboard is, every (panel title, expr) in it, and the metric
names a PromQL expression selects."""

from __future__ import annotations

import re

from cluster_helpers import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "afd-dashboard.json"


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
