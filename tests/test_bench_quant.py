"""`afd bench-quant` on a tiny model (dummy weights, so no HF): the result's shape, and that every measured
mode ran with the quantization it names (colocated: the experts' storage dtype; 1A1F: the FFN node's own
log line). test-slow runs the 1A1F, memory and wire sections too."""

from __future__ import annotations

import json

import pytest

from afd.bench.common import write_config
from afd.entrypoints.cli import main
from tests.bench_helpers import TINY_LONGCAT


def _bench(tmp_path, *extra) -> dict:
    out = tmp_path / "out.json"
    model = write_config(str(tmp_path / "m"), TINY_LONGCAT)
    argv = ["bench-quant", "--model", model, "--modes", "fp32,w8a8", "--batches", "2", "--steps", "2"]
    argv += ["--warmup-steps", "1", "--repeats", "1", "--gemm-tokens", "2", "--output", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_bench_quant_colocated(tmp_path, capsys):
    res = _bench(tmp_path, "--topologies", "colocated", "--sections", "decode,gemm")
    assert res["checkpoint"] == "dummy weights"
    d = res["decode"]
    assert set(d["results"]) == {"colocated fp32 b=2", "colocated w8a8 b=2"}
    assert all(len(v) == 1 and v[0]["tok_s"] > 0 for v in d["rounds"].values())
    assert d["quantization"]["colocated fp32"].startswith("experts float32, 0 quantized")
    assert d["quantization"]["colocated w8a8"].startswith("experts int8,")
    g = res["gemm"]["results_ms"]
    assert set(g) == {"fp32", "w8a8"} and set(g["fp32"]) < set(g["w8a8"])
    assert any("torch._int_mm" in k for k in g["w8a8"]) and not any("torch._int_mm" in k for k in g["fp32"])
    assert any(k.startswith("experts w13 grouped") for k in g["w8a8"]) and "FFN half (all MoE layers)" in g["w8a8"]
    out = capsys.readouterr().out
    assert "| colocated | w8a8 |" in out and "fp32 / w8a8" in out
    # the kernels the run's w8a8 GEMMs took, chosen by timing on this machine, with the machine's flags
    assert res["machine"]["cpu_flags"] and any(label.startswith("w8a8_grouped float32") for label in res["kernels"])
    assert "Kernels chosen by timing on this machine" in out and "| w8a8_grouped float32 " in out


@pytest.mark.slow
def test_bench_quant_nodes(tmp_path, capsys):
    res = _bench(
        tmp_path, "--topologies", "1A1F", "--sections", "decode,memory,wire", "--memory-model", str(tmp_path / "m")
    )
    q = res["decode"]["quantization"]
    assert q["1A1F fp32"] == "none" and q["1A1F w8a8"].startswith("w8a8: weights int8 per channel")
    mem = res["memory"]["results"]
    assert mem["w8a8"]["large"]["expert_dtype"] == "torch.int8" and mem["w8a8"]["large"]["ffn_quantization"] != "none"
    assert mem["w8a8"]["bench"]["expert_bytes"] < mem["fp32"]["bench"]["expert_bytes"] / 3
    wire = res["wire"]["results"]
    assert set(wire) == {"same", "fp8", "int8"}
    assert all(w["counted_to_ffn"] == w["formula_to_ffn"] for w in wire.values())
