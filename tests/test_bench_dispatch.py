"""`afd bench-dispatch`'s pieces without node processes: the formula on real shapes, the per-job figures and
their counted = formula check, the /metrics parsing, the cluster YAML's metrics ports, the skewed prompts.
test-slow runs the command on a tiny model (dummy weights)."""

from __future__ import annotations

import json

import pytest
import yaml

from afd.bench import dispatch, dispatch_parts
from afd.bench.common import write_config
from afd.cluster.local_config import local_job
from afd.config.placement import default_placement, expected_fanout, routed_fanout
from afd.dataplane.protocol import COUNT_BYTES
from afd.entrypoints.cli import main
from tests.bench_helpers import TINY_LONGCAT, bench_args


def test_the_command_is_registered(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench-dispatch", "--help"])
    assert e.value.code == 0 and "--rebalance-ffn-nodes" in capsys.readouterr().out
    args = bench_args(dispatch, "bench-dispatch", ["--ffn-nodes", "1,2"])
    assert args.ffn_nodes == "1,2" and args.sections == "wire,shapes,rebalance"


def test_shapes_by_formula():
    s = dispatch_parts.shape_figures([8, 32])
    ds = s["DeepSeek-V3"]["by_ffn_nodes"]
    # 8 nodes hold one group each: a token reaches at most its 4 groups' nodes
    assert ds["8"]["max_fanout"] == 4 and ds["8"]["fanout"] < 4
    assert ds["8"]["broadcast to_ffn"] == 8 * 7168 * 2
    assert ds["8"]["dispatch to_ffn"] == pytest.approx(ds["8"]["fanout"] * (7168 * 2 + 8 * 8))
    for v in s.values():
        r = v["by_ffn_nodes"]
        assert 0 < r["32"]["ratio"] < r["8"]["ratio"] < 1  # more nodes, a smaller share of them per token
    lc = s["LongCat-Flash"]["by_ffn_nodes"]["8"]
    assert lc["fanout_routed_only"] < lc["fanout"] and lc["ratio_routed_only"] < lc["ratio"]


def test_routed_fanout_without_identity_experts_is_the_placements():
    p = default_placement(16, ["ffn0", "ffn1", "ffn2", "ffn3"])
    assert routed_fanout(p, 2, 1, 1, 0) == expected_fanout(p, 2)
    assert routed_fanout(p, 2, 1, 1, 16) < expected_fanout(p, 2)


def _job(rows: int, tokens: int, steps: int, to_ffn: int) -> dict:
    return {"tokens": tokens, "steps": steps, "rows": rows, "to_ffn": to_ffn}


def test_wire_figures_put_the_counts_back():
    H, K, L, F, T, S = 256, 2, 4, 3, 40, 5  # T tokens over S steps
    rows = 70 * L  # 70 rows per layer reached the FFN nodes: fan-out 1.75
    sent = rows * (H * 4 + 8 * K) + COUNT_BYTES * F * L * S
    f = dispatch_parts.wire_figures(_job(rows, T, S, sent), F, "attention", L, H, "float32", K, 1.8)
    assert f["counted_equals_formula"] and f["fanout"] == 1.75
    assert f["counted"] == pytest.approx(f["formula_measured_fanout"] + f["counts_share"])
    assert f["formula_expected_fanout"] == pytest.approx(1.8 * (H * 4 + 8 * K))
    off = dispatch_parts.wire_figures(_job(rows, T, S, sent + 1), F, "attention", L, H, "float32", K, 1.8)
    assert not off["counted_equals_formula"]
    b = dispatch_parts.wire_figures(_job(F * T * L, T, S, F * T * L * H * 4), F, "ffn", L, H, "float32", K, 1.8)
    assert b["counted_equals_formula"] and b["fanout"] == F and b["counts_share"] == 0


def test_ffn_counts_from_metrics_text():
    text = "\n".join(
        [
            "# TYPE afd_ffn_tokens_total counter",
            'afd_ffn_tokens_total{model_name="m",node="ffn1",role="ffn"} 12.0',
            "# TYPE afd_expert_tokens_total counter",
            'afd_expert_tokens_total{expert="4",model_name="m",node="ffn1",role="ffn"} 7.0',
            'afd_expert_tokens_total{expert="5",model_name="m",node="ffn1",role="ffn"} 3.0',
            "",
        ]
    )
    assert dispatch_parts.ffn_counts(text) == {"rows": 12.0, "experts": {4: 7.0, 5: 3.0}}


def test_the_ffn_nodes_get_metrics_ports(tmp_path):
    model = write_config(str(tmp_path / "m"), TINY_LONGCAT)
    cluster = dispatch_parts.MetricsCluster(local_job(model, 1, 2, dummy_weights=True, routing="attention"))
    cluster.processes.start_all = lambda commands: None  # no node processes: the YAML is what is checked
    try:
        cluster.start()
        with open(f"{cluster.dir}/cluster.yaml") as f:
            doc = yaml.safe_load(f)
    finally:
        cluster.stop()
    ports = [p for n in doc["nodes"] for p in n["ports"].values()]
    assert len(ports) == len(set(ports))
    ffn = {n["name"]: n["ports"]["metrics"] for n in doc["nodes"] if n["role"] == "ffn"}
    assert cluster.metrics_urls == {k: f"http://127.0.0.1:{p}/metrics" for k, p in ffn.items()}
    assert doc["layout"]["routing"] == "attention"


def test_skewed_prompts():
    p = dispatch_parts.skewed_prompts(7, 5, 97, 3)
    assert len(p) == 7 and len({tuple(x) for x in p}) == 3 and all(len(set(x)) == 1 and 3 <= x[0] < 97 for x in p)


@pytest.mark.slow
def test_bench_dispatch_runs(tmp_path, capsys):
    out = tmp_path / "out.json"
    model = write_config(str(tmp_path / "m"), TINY_LONGCAT)
    argv = ["bench-dispatch", "--model", model, "--ffn-nodes", "1,2", "--batch", "2", "--steps", "2"]
    argv += ["--warmup-steps", "1", "--repeats", "1", "--rebalance-ffn-nodes", "2", "--skewed-prompts", "4"]
    argv += ["--shape-ffn-nodes", "8", "--output", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["checkpoint"] == "dummy weights"
    w = res["wire"]["results"]
    assert set(w) == {"F=1 broadcast", "F=1 dispatch", "F=2 broadcast", "F=2 dispatch"}
    assert all(r["counted_equals_formula"] for r in w.values())
    assert w["F=2 broadcast"]["fanout"] == 2 and 1 <= w["F=2 dispatch"]["fanout"] <= 2
    r = res["rebalance"]
    assert r["computed"]["after"] <= r["computed"]["before"]
    assert "| after |" in capsys.readouterr().out
