"""What `afd bench-dispatch` (afd.bench.dispatch) is built from: local clusters whose FFN nodes serve
/metrics, one job's counts read from both sides, the bench checkpoint, the skewed prompt set, and the wire
formula on real model shapes."""

from __future__ import annotations

import os
import urllib.request
from typing import Any

from afd.bench.common import median
from afd.bench.quant_parts import tok_s
from afd.cluster.local import LocalCluster
from afd.config.placement import default_placement, expected_fanout, max_fanout, routed_fanout
from afd.config.schema import ClusterConfig
from afd.dataplane.protocol import COUNT_BYTES
from afd.dataplane.wire_cost import per_token
from afd.model.demo_config import DEMO_CONFIG

BENCH_MODEL = {**DEMO_CONFIG, "moe_topk": 2, "zero_expert_num": 0}
"""The demo model (LongCat-Flash shape, hidden 256, 4 layers with one MoE each) with 16 routed experts, top-2
and no identity experts: every chosen slot crosses to an FFN node."""

SHAPES: dict[str, dict[str, Any]] = {
    # name: hidden, routed experts, top-k, (groups, topk_group), identity experts; from the models' config.json
    # (afd/model/deepseek_v3/config.py, qwen3_moe/config.py, longcat_flash/config.py defaults)
    "DeepSeek-V3": dict(hidden=7168, n_routed=256, top_k=8, groups=(8, 4), zero=0),
    "Qwen3-235B-A22B": dict(hidden=4096, n_routed=128, top_k=8, groups=(1, 1), zero=0),
    "LongCat-Flash": dict(hidden=6144, n_routed=512, top_k=12, groups=(1, 1), zero=256),
}


class MetricsCluster(LocalCluster):
    """A LocalCluster whose FFN nodes also serve /metrics on free ports (ffn_metrics), read before and after
    each job (`metrics_urls`: FFN node name -> its /metrics URL, once started)."""

    def __init__(self, config: ClusterConfig):
        super().__init__(config, ffn_metrics=True)

    def scrape(self) -> dict[str, dict]:
        """Per FFN node: {"rows": afd_ffn_tokens_total, "experts": {expert: afd_expert_tokens_total}}."""
        out = {}
        for name, url in self.metrics_urls.items():
            with urllib.request.urlopen(url, timeout=10) as r:
                out[name] = ffn_counts(r.read().decode())
        return out


def ffn_counts(text: str) -> dict:
    """An FFN node's /metrics text -> {"rows": tokens through its MoE layers, "experts": {expert: tokens}}."""
    from prometheus_client.parser import text_string_to_metric_families

    rows, experts = 0.0, {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "afd_ffn_tokens_total":
                rows += s.value
            elif s.name == "afd_expert_tokens_total":
                experts[int(s.labels["expert"])] = s.value
    return {"rows": rows, "experts": experts}


def run_job(cluster: MetricsCluster, prompts: list[list[int]], new_tokens: int, warmup: int, n_routed: int) -> dict:
    """One job, with the FFN nodes' counters read before and after it: what the attention node counted it
    sent (a2f_bytes: the count afd_exchange_bytes_total{direction="to_ffn"} exports), the tokens and steps it
    ran, the rows each FFN node received (afd_ffn_tokens_total) and the expert assignments it computed
    (afd_expert_tokens_total), and the decode step time past `warmup` steps."""
    before = cluster.scrape()
    _, reports = cluster.generate(prompts, new_tokens, ignore_eos=True)
    after = cluster.scrape()
    steps = reports[0]["steps"]
    node_rows = {n: after[n]["rows"] - before[n]["rows"] for n in after}
    loads = [0.0] * n_routed
    node_assign = {}
    for n in after:
        delta = {e: v - before[n]["experts"].get(e, 0.0) for e, v in after[n]["experts"].items()}
        node_assign[n] = sum(delta.values())
        for e, v in delta.items():
            loads[e] += v
    return {
        "step_ms": tok_s(steps, warmup)["step_ms"],
        "tokens": sum(s["tokens"] for s in steps),
        "steps": len(steps),
        "to_ffn": reports[0]["a2f_bytes"],
        "rows": sum(node_rows.values()),
        "node_rows": node_rows,
        "node_assignments": node_assign,
        "expert_loads": loads,
    }


def wire_figures(job: dict, F: int, routing: str, moe_layers: int, hidden: int, dtype: str, top_k: int,
                 expected: float) -> dict:  # fmt: skip
    """Bytes per token per MoE layer to the FFN nodes: as counted, and by wire_cost.per_token at the measured
    fan-out (rows received / tokens / layers) and at the expected one. The counted bytes hold the dispatch
    counts (COUNT_BYTES per FFN node, layer and step, one micro-batch) which per_token leaves out: the check
    puts them back, so that counted = formula exactly when both sides agree on every row."""
    T, L = job["tokens"], moe_layers
    fan = job["rows"] / (T * L)
    key = "broadcast to_ffn" if routing == "ffn" else "dispatch to_ffn"
    at_measured = per_token(hidden, dtype, top_k, "same", F, fan)[key]
    at_expected = per_token(hidden, dtype, top_k, "same", F, expected if routing != "ffn" else F)[key]
    counts = COUNT_BYTES * F * L * job["steps"] if routing != "ffn" else 0
    return {
        "counted": job["to_ffn"] / (T * L),
        "counts_share": counts / (T * L),
        "fanout": fan,
        "formula_measured_fanout": at_measured,
        "formula_expected_fanout": at_expected,
        "expected_fanout": expected if routing != "ffn" else float(F),
        "counted_equals_formula": abs(at_measured * T * L + counts - job["to_ffn"]) < 1e-6 * job["to_ffn"],
    }


def bench_checkpoint(model: str | None, tmp: str) -> tuple[str, bool]:
    """(path, dummy): --model (dummy weights when it holds only config.json), or BENCH_MODEL written as
    safetensors with random weights (seed 0)."""
    if model is not None:
        return model, not any(f.endswith(".safetensors") for f in os.listdir(model))
    from afd.model.demo import write_checkpoint

    path = os.path.join(tmp, "bench-dispatch-ckpt")
    write_checkpoint(path, BENCH_MODEL, seed=0)
    return path, False


def skewed_prompts(n: int, length: int, vocab: int, distinct: int) -> list[list[int]]:
    """n prompts that are `distinct` prompts repeated, each one token id `length` times: the same few
    hidden states over and over, which a router sends to the same few experts."""
    ids = [3 + (41 * k + 5) % (vocab - 3) for k in range(distinct)]
    return [[ids[i % distinct]] * length for i in range(n)]


def shape_figures(ffn_nodes: list[int], dtype: str = "bfloat16") -> dict:
    """wire_cost.per_token on real model shapes at each FFN node count, default placement, bf16, no
    exchange quantization: broadcast vs dispatch, at the expected fan-out of uniform routing with identity
    picks counted as crossing and, with identity experts, at the fan-out of only the routed picks crossing
    (what crosses, and what `afd check-config` prints)."""
    out: dict = {}
    for name, s in SHAPES.items():
        rows = {}
        for F in ffn_nodes:
            groups, topk_group = s["groups"]
            p = default_placement(s["n_routed"], [f"ffn{i}" for i in range(F)], groups)
            fan = expected_fanout(p, s["top_k"], groups, topk_group)
            cost = per_token(s["hidden"], dtype, s["top_k"], "same", F, fan)
            row = {"fanout": fan, "max_fanout": max_fanout(p, s["top_k"], groups, topk_group)} | cost
            row["ratio"] = cost["dispatch to_ffn"] / cost["broadcast to_ffn"]
            if s["zero"]:
                fz = routed_fanout(p, s["top_k"], groups, topk_group, s["zero"])
                row |= {"fanout_routed_only": fz, "ratio_routed_only": fz * row["ratio"] / fan}
            rows[str(F)] = row
        out[name] = {"shape": s, "by_ffn_nodes": rows}
    return out


def medians(rounds: list[dict], keys) -> dict:
    return {k: median(r[k] for r in rounds) for k in keys}


def max_mean(xs) -> float:
    """max / mean: 1.0 is even (and when nothing was counted)."""
    v = list(xs)
    return max(v) / (sum(v) / len(v)) if sum(v) else 1.0
