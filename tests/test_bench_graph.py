"""`afd bench-graph` end to end on a tiny model, colocated (aot_eager in inductor's place: the bench's own
logic, not the compiler, is what this checks; test-slow runs 1A1F and the compile-time probe too)."""

from __future__ import annotations

import json

import pytest
import torch

from afd.backend.cpu import CpuBackend
from afd.bench.common import write_config
from afd.entrypoints.cli import main

TINY = {
    "model_type": "longcat_flash",
    "vocab_size": 64,
    "hidden_size": 32,
    "num_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "ffn_hidden_size": 48,
    "q_lora_rank": 16,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "head_dim": 4,
    "v_head_dim": 8,
    "moe_topk": 2,
    "n_routed_experts": 4,
    "zero_expert_num": 1,
    "expert_ffn_hidden_size": 16,
    "max_position_embeddings": 256,
    "eos_token_id": 2,
}


def _bench(tmp_path, *extra) -> dict:
    out = tmp_path / "out.json"
    model = write_config(str(tmp_path / "m"), TINY)
    assert (
        main(
            [
                "bench-graph",
                "--model",
                model,
                "--batch-sizes",
                "3",
                "--prompt-len",
                "20",
                "--steps",
                "3",
                "--repeats",
                "2",
                "--output",
                str(out),
                *extra,
            ]
        )
        == 0
    )
    return json.loads(out.read_text())


def test_bench_graph_colocated(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(CpuBackend, "graph_compiler", "aot_eager")
    torch._dynamo.reset()
    res = _bench(tmp_path, "--topologies", "colocated", "--no-compile-time")
    assert set(res["decode"]["results"]) == {f"colocated b=3 {m}" for m in ("eager", "compile")}
    assert all(len(v) == 2 and min(v) > 0 for v in res["decode"]["rounds"].values())
    assert "| colocated | 3 |" in capsys.readouterr().out


def test_bench_graph_ffn_layer(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(CpuBackend, "graph_compiler", "aot_eager")
    res = _bench(tmp_path, "--no-decode", "--no-compile-time", "--ffn")
    assert "decode" not in res and set(res["ffn"]["results_ms"]) == {"T=3 eager", "T=3 compile"}
    assert all(len(v) == 2 and min(v) > 0 for v in res["ffn"]["rounds"].values())
    assert "| 3 |" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_graph_everything(tmp_path, capsys):
    res = _bench(tmp_path)
    assert {k.split()[0] for k in res["decode"]["results"]} == {"colocated", "1A1F"}
    assert set(res["compile"]) == {"cold", "warm"} and set(res["compile"]["cold"]) == {"3"}
    assert "cold cache" in capsys.readouterr().out
