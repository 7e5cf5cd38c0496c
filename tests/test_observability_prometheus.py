"""Observability end to end: a real Prometheus, given the rendered scrape config, scrapes a real cluster
serving requests, and every dashboard query returns data (skipped where Prometheus is not installed:
`.ci/prometheus.sh` installs it).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster_helpers import Cluster, cluster_yaml, free_ports, get, post, skip_unless_ci_installs, wait_for
from dashboard_helpers import DASHBOARD, dashboard_exprs, promql_metric_names
from metrics_text import samples, total

from afd.config.loader import load
from afd.control import control_pb2 as pb
from afd.entrypoints.prometheus_config import render
from afd.model.demo_config import DEMO_CONFIG

PROMETHEUS_MISSING = "prometheus not installed: run .ci/prometheus.sh or apt-get install prometheus"


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
