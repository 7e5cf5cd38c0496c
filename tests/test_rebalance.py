"""`afd rebalance`: the greedy placement (afd/cluster/rebalance.py) and the command around it
(afd/entrypoints/rebalance.py), on saved /metrics text and a stand-in /metrics server; no node processes."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from afd.cluster.rebalance import imbalance, node_loads, rebalance, replica_counts
from afd.config.loader import check_expert_layout, load
from afd.config.placement import Placement, default_placement
from afd.entrypoints.cli import main
from afd.entrypoints.rebalance import expert_bytes, expert_tokens
from afd.model.deepseek_v3.config import DeepseekV3Config
from afd.model.demo_config import DEMO_CONFIG
from afd.model.registry import config_from_hf

NODES = ["ffn0", "ffn1", "ffn2", "ffn3"]
ZIPF = [1000.0 / (e + 1) for e in range(16)]  # expert 0 the hottest


def check_valid(p: Placement, slots: int) -> None:
    """Placement's own checks hold every expert once at least, ascending without repeats on a node; the
    budget is rebalance's."""
    assert all(len(h) <= slots for h in p.held)
    assert all(len(set(h)) == len(h) for h in p.held)
    assert {e for h in p.held for e in h} == set(range(p.n_routed))


def test_skewed_loads_end_more_even_and_the_hottest_are_replicated():
    before = default_placement(16, NODES)
    p = rebalance(ZIPF, NODES, 5, before)
    check_valid(p, 5)
    assert imbalance(before, ZIPF) > 2.0 and imbalance(p, ZIPF) < 1.1
    assert [len(p.holders(e)) for e in range(4)] == [
        4,
        2,
        1,
        1,
    ]  # spare slots: 1000, 500/500 (tie: lower id), 500, 333/333
    assert sum(len(h) for h in p.held) == 20


def test_uniform_loads_stay_even_and_an_even_placement_is_kept():
    loads, before = [5.0] * 16, default_placement(16, NODES)
    for slots in (4, 5, 8):
        p = rebalance(loads, NODES, slots)
        check_valid(p, slots)
        assert imbalance(p, loads) == pytest.approx(1.0)
        assert rebalance(loads, NODES, slots, before) is before  # as even: no weights move
    assert rebalance(loads, NODES, [4, 4, 3, 5], before) != before  # it no longer fits


def test_random_loads_keep_every_rule_and_are_deterministic():
    rng = random.Random(0)
    for _ in range(50):
        n, F = rng.choice([(16, 4), (64, 8), (8, 8), (12, 5)])
        nodes = [f"f{i}" for i in range(F)]
        slots = rng.randint(-(-n // F), n)
        loads = [rng.paretovariate(1.2) * (rng.random() > 0.2) for _ in range(n)]
        p = rebalance(loads, nodes, slots)
        check_valid(p, slots)
        assert rebalance(loads, nodes, slots) == p
        assert max(len(p.holders(e)) for e in range(n)) <= F
        assert imbalance(p, loads) <= imbalance(default_placement(n, nodes), loads) + 1e-9


def test_uneven_budgets_never_put_an_expert_twice_on_a_node():
    p = rebalance([10.0, 9.0], ["a", "b"], [3, 1])  # 4 slots, but b has room for one replica only
    check_valid(p, 3)
    assert len(p.held[1]) == 1


def test_a_replicated_layout_keeps_its_redundancy_unless_told_otherwise():
    """A regression: from a layout where every expert had two holders, skewed loads gave one where four experts had
    a single holder, so that node's loss paused every stream again. The fewest holders any expert has now is
    the floor (--min-replicas sets another)."""
    from afd.cluster.rebalance import min_holders
    from afd.config.placement import from_yaml

    nodes = ["f0", "f1", "f2"]
    current = from_yaml({"f0": "0-9", "f1": "0-4,10-15", "f2": "5-15"}, 16, nodes)
    assert min_holders(current) == 2
    loads = [100.0, 80.0, 60.0] + [1.0] * 13
    kept = rebalance(loads, nodes, 11, current)
    check_valid(kept, 11)
    assert min_holders(kept) == 2 and kept != current
    assert min_holders(rebalance(loads, nodes, 11, current, min_replicas=1)) == 1  # asked: redundancy may go
    with pytest.raises(ValueError, match=r"cannot hold the 16 routed experts 3 times each \(--min-replicas\)"):
        rebalance(loads, nodes, 11, current, min_replicas=3)


def test_replica_counts_go_to_the_highest_load_per_replica_capped_at_the_nodes():
    assert replica_counts([8.0, 3.0, 1.0], 6, 2) == [2, 2, 2]
    assert replica_counts([8.0, 3.0, 1.0], 5, 3) == [3, 1, 1]  # 8, then 8/2 = 4 > 3
    assert replica_counts([0.0, 0.0], 3, 2) == [2, 1]  # ties: the lowest id


def test_node_loads_split_a_replicated_expert_evenly():
    p = Placement(3, ("a", "b"), ((0, 1), (0, 2)))
    assert node_loads(p, [10.0, 1.0, 2.0]) == [6.0, 7.0]
    assert imbalance(p, [10.0, 1.0, 2.0]) == pytest.approx(7.0 / 6.5)
    assert imbalance(p, [0.0, 0.0, 0.0]) == 1.0


def test_too_few_slots_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"12 expert slots on 4 FFN nodes .* 16 routed experts"):
        rebalance(ZIPF, NODES, 3)
    with pytest.raises(ValueError, match="at least one expert slot"):
        rebalance(ZIPF, NODES, [5, 5, 5, 0])


def test_expert_bytes_by_family():
    demo = config_from_hf(DEMO_CONFIG)  # LongCat-Flash: expert_ffn_hidden_size, an MoE in every layer
    assert expert_bytes(demo, "float32", False) == 3 * 256 * 128 * 4 * 4
    deepseek = DeepseekV3Config(
        hidden_size=7168, moe_intermediate_size=2048, num_hidden_layers=61, first_k_dense_replace=3
    )
    assert expert_bytes(deepseek, "bfloat16", True) == 3 * 7168 * 2048 * 58


# ---- the command ----------------------------------------------------------------------------------


def metrics_text(node: str, counts: dict[int, float]) -> str:
    """An FFN node's /metrics as afd/observability/ffn_metrics.py writes it (labels: BASE_LABELS + expert)."""
    lines = [
        "# HELP afd_expert_tokens_total Token-expert assignments per routed expert.",
        "# TYPE afd_expert_tokens_total counter",
    ]
    for e, n in counts.items():
        lines.append(f'afd_expert_tokens_total{{expert="{e}",model_name="demo",node="{node}",role="ffn"}} {n}')
    lines += [
        "# HELP afd_zero_expert_tokens_total Token assignments to zero-computation (identity) experts.",
        "# TYPE afd_zero_expert_tokens_total counter",
        f'afd_zero_expert_tokens_total{{model_name="demo",node="{node}",role="ffn"}} 0.0',
    ]
    return "\n".join(lines) + "\n"


def cluster_yaml(path, metrics_ports=(9301, 9302, 9303, 9304), model: str = "demo") -> str:
    nodes = [
        {
            "name": "attn0",
            "role": "attention",
            "host": "127.0.0.1",
            "ports": {"control": 50301, "data": 29301, "http": 8301},
        }
    ]
    for i, port in enumerate(metrics_ports):
        ports = {"control": 50302 + i, "data": 29302 + i, **({"metrics": port} if port else {})}
        nodes.append({"name": f"ffn{i}", "role": "ffn", "host": "127.0.0.1", "ports": ports})
    raw = {"cluster": {"name": "rebal"}, "model": {"path": model}, "engine": {"block_size": 16}, "nodes": nodes}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def saved_metrics(tmp_path) -> list[str]:
    paths = []
    for name, held in zip(NODES, default_placement(16, NODES).held):
        p = tmp_path / f"{name}.txt"
        p.write_text(metrics_text(name, {e: ZIPF[e] for e in held}))
        paths.append(str(p))
    return paths


def test_rebalance_writes_a_yaml_check_config_accepts(tmp_path, capsys):
    cfg_path, out = cluster_yaml(tmp_path / "c.yaml"), str(tmp_path / "new.yaml")
    argv = ["rebalance", cfg_path, *[a for m in saved_metrics(tmp_path) for a in ("--metrics", m)]]
    assert main([*argv, "--output", out]) == 0
    text = capsys.readouterr().out
    assert "5 expert slots per node (default" in text and "max/mean" in text and "replicated: 0-1" in text
    new = load(out)
    p = check_expert_layout(new, 16)
    assert new.routing == "attention" and new.layout.routing == "attention"
    assert [len(p.holders(e)) for e in range(3)] == [4, 2, 1]
    assert imbalance(p, ZIPF) < 1.1
    old = load(cfg_path)
    assert new.nodes == old.nodes and new.engine == old.engine and new.model == old.model
    assert main(["check-config", out]) == 0
    assert "ffn0" in capsys.readouterr().out
    assert main([*argv, "--write", "--expert-slots", "4"]) == 0  # FILE rewritten in place
    assert check_expert_layout(load(cfg_path), 16).replicated is False
    written = Path(cfg_path).read_text()
    assert main([*argv, "--write", "--expert-slots", "4"]) == 0  # as even already: FILE left as it is
    assert "nothing to change" in capsys.readouterr().out and Path(cfg_path).read_text() == written


def test_a_deploy_yaml_keeps_everything_but_the_placement(tmp_path, capsys):
    """deploy/1a2f.yaml spells out defaults and an uneven placement: only layout.placement changes."""
    old = load("deploy/1a2f.yaml")
    files = []
    for name, held in zip(old.placement(16).nodes, old.placement(16).held):
        files += ["--metrics", str(tmp_path / f"{name}.txt")]
        (tmp_path / f"{name}.txt").write_text(metrics_text(name, {e: ZIPF[e] for e in held}))
    out = str(tmp_path / "new.yaml")
    assert main(["rebalance", "deploy/1a2f.yaml", *files, "--output", out]) == 0
    new = load(out)
    assert dataclasses.replace(new, layout=old.layout, source=old.source) == old
    assert dataclasses.replace(new.layout, placement=old.layout.placement) == old.layout
    assert yaml.safe_load(Path(out).read_text())["engine"]["shutdown_timeout"] == 30  # an explicit default kept
    p = check_expert_layout(new, 16)
    assert sum(map(len, p.held)) == 24  # 12 slots per node (the largest, 10, + 25% of 16/2): 8 replicas


def test_memory_budget_counts_one_expert_over_every_moe_layer(tmp_path, capsys):
    cfg_path = cluster_yaml(tmp_path / "c.yaml")
    one = expert_bytes(config_from_hf(DEMO_CONFIG), "float32", False)
    metrics = [a for m in saved_metrics(tmp_path) for a in ("--metrics", m)]
    assert main(["rebalance", cfg_path, *metrics, "--memory-budget", str(6 * one + 1)]) == 0
    assert "6 expert slots per node" in capsys.readouterr().out
    assert main(["rebalance", cfg_path, *metrics, "--memory-budget", str(3 * one)]) == 2
    assert "12 expert slots" in capsys.readouterr().err


DEEPSEEK_FP8 = dict(
    model_type="deepseek_v3",
    vocab_size=97,
    hidden_size=32,
    moe_intermediate_size=12,
    num_hidden_layers=3,
    first_k_dense_replace=1,  # MoE layers 1 and 2
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=3,
    quantization_config={
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
)


def test_a_deepseek_fp8_checkpoint_budgets_one_byte_weights_and_warns_of_groups(tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(DEEPSEEK_FP8))
    cfg_path = cluster_yaml(tmp_path / "c.yaml", (9301, 9302), model=str(tmp_path / "ckpt"))
    one = 3 * 32 * 12 * 1 * 2  # gate, up, down; FP8; two MoE layers
    files = []
    for name, held in zip(("ffn0", "ffn1"), ((0, 1, 2, 3), (4, 5, 6, 7))):  # the default: whole groups
        files += ["--metrics", str(tmp_path / f"{name}.txt")]
        (tmp_path / f"{name}.txt").write_text(metrics_text(name, {e: ZIPF[e] for e in held}))
    assert main(["rebalance", cfg_path, *files, "--memory-budget", str(5 * one)]) == 0
    out = capsys.readouterr().out
    assert f"5 expert slots per node (--memory-budget {5 * one} B / {one} B per expert)" in out
    assert "2 expert groups are not kept together" in out


def test_bad_inputs_exit_2_naming_them(tmp_path, capsys):
    cfg_path = cluster_yaml(tmp_path / "c.yaml")
    metrics = saved_metrics(tmp_path)
    assert main(["rebalance", cfg_path, "--metrics", str(tmp_path / "gone.txt")]) == 2
    assert "gone.txt" in capsys.readouterr().err
    assert main(["rebalance", cfg_path, "--metrics", metrics[0]]) == 0  # ffn0's file only: the others count 0
    assert "expert(s) 4-15 in no metrics, counted 0" in capsys.readouterr().out
    assert main(["rebalance", cfg_path, "--metrics", metrics[0], "--expert-slots", "3"]) == 2
    err = capsys.readouterr().err
    assert "12 expert slots" in err and "16 routed experts" in err
    (tmp_path / "attn.txt").write_text("# TYPE afd_num_requests_running gauge\nafd_num_requests_running 0\n")
    assert main(["rebalance", cfg_path, "--metrics", str(tmp_path / "attn.txt")]) == 2
    assert "no afd_expert_tokens_total" in capsys.readouterr().err
    (tmp_path / "big.txt").write_text(metrics_text("ffn0", {99: 1.0}))
    assert main(["rebalance", cfg_path, "--metrics", str(tmp_path / "big.txt")]) == 2
    assert "expert='99'" in capsys.readouterr().err


@contextlib.contextmanager
def metrics_servers(texts: list[str]):
    """One /metrics server per text on loopback; yields their ports."""
    servers = []
    for text in texts:

        class Handler(BaseHTTPRequestHandler):
            body = text.encode()

            def do_GET(self):  # noqa: N802
                self.send_response(200)
                self.send_header("Content-Length", str(len(self.body)))
                self.end_headers()
                self.wfile.write(self.body)

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
    try:
        yield [s.server_address[1] for s in servers]
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_loads_are_scraped_from_the_ffn_nodes_by_default(tmp_path, capsys):
    held = default_placement(16, NODES).held
    texts = [metrics_text(n, {e: ZIPF[e] for e in h}) for n, h in zip(NODES, held)]
    with metrics_servers(texts) as ports:
        assert main(["rebalance", cluster_yaml(tmp_path / "a.yaml", ports)]) == 0
        assert "from 4 FFN nodes' /metrics" in capsys.readouterr().out
        assert main(["rebalance", cluster_yaml(tmp_path / "b.yaml", [*ports[:3], closed_port()])]) == 2
        assert "FFN node ffn3: http://127.0.0.1:" in capsys.readouterr().err
        assert main(["rebalance", cluster_yaml(tmp_path / "c.yaml", [*ports[:3], None])]) == 2
        assert "ffn3 has no ports.metrics" in capsys.readouterr().err


def test_the_ffn_nodes_own_metrics_text_parses():
    """What FFNMetrics renders (the real exporter, torch and all) reads back as its counts."""
    pytest.importorskip("torch")
    from afd.observability.ffn_metrics import FFNMetrics

    m = FFNMetrics("ffn1", "demo", [4, 5, 6, 7], num_layers=4)
    m.add_expert_tokens([10, 0, 3, 7])
    assert expert_tokens(m.render().decode(), "ffn1", 16) == {4: 10.0, 5: 0.0, 6: 3.0, 7: 7.0}
