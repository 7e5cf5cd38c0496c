"""`afd bench-suite`: the grouped-GEMM section end to end (quick), and the reference MoE loops it times."""

from __future__ import annotations

import argparse
import json

import pytest

from afd.bench import gemm as bench_gemm
from afd.bench import suite as bench_suite


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_suite.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench-suite", *argv])


def test_quick_gemm_section_writes_three_variants_per_token_count(tmp_path, capsys):
    out = tmp_path / "suite.json"
    args = _args(["--quick", "--sections", "gemm", "--repeats", "2", "--output", str(out)])
    assert args.func(args) == 0
    gemm = json.loads(out.read_text())["gemm"]
    assert sorted(gemm, key=int) == ["8", "32", "128"]
    for r in gemm.values():
        assert set(r["ms"]) == {"grouped", "naive", "dense"}
        assert all(t > 0 for t in r["ms"].values())
        assert all(len(v) == 2 for v in r["rounds_ms"].values())
        assert r["grouped_equals_naive"] and r["grouped_equals_dense"]
    assert "| 128 |" in capsys.readouterr().out


@pytest.mark.parametrize("T", [5])
def test_naive_and_dense_experts_equal_grouped(T):
    res = bench_gemm.check_grouped_vs_naive(T)
    assert res["grouped_equals_naive"], res
    assert res["grouped_equals_dense"], res
    assert res["max_abs_diff_naive"] <= 1e-5 * res["output_abs_max"] + 1e-6


def test_unknown_section_is_rejected():
    with pytest.raises(ValueError, match="unknown section"):
        bench_suite.run(_args(["--sections", "gemm,nope"]))


def test_naive_loop_is_hf_longcat_flash_experts():
    """The timed per-expert loop computes what transformers' LongcatFlashMoE computes from the same routing:
    its routed experts and its identity (zero) experts. The MoE layer, not LongcatFlashExperts alone: from
    transformers 5.25 the identity experts are summed in LongcatFlashMoE, and its experts hold the routed
    ones only (5.24 gave them gate/up rows for the identity experts too). HF's eager experts, the per-expert
    loop the naive one is; assert_close's default fp32 tolerance, as HF adds the identity experts' share after
    the routed ones and the loop adds it in expert order."""
    pytest.importorskip("transformers")
    import torch
    from transformers import LongcatFlashConfig
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashMoE

    cfg, layer, hf, _ = bench_gemm._moe_layer()
    x, weights, ids = bench_gemm._gemm_inputs(layer, 12, cfg.hidden_size, seed=1)
    hf_cfg = LongcatFlashConfig(**{k: v for k, v in bench_suite.HF_CONFIG.items() if k != "architectures"})
    hf_cfg._experts_implementation = "eager"
    moe = LongcatFlashMoE(hf_cfg)
    moe.router.forward = lambda _: (None, weights, ids)  # the routing under test, not HF's router's
    with torch.no_grad():
        moe.experts.gate_up_proj.copy_(hf["gate_up"][: moe.experts.gate_up_proj.shape[0]])
        moe.experts.down_proj.copy_(hf["down"])
        ref = moe(x)
    ours = bench_gemm.naive_experts(x, weights, ids, hf["gate_up"], hf["down"], hf["n_routed"])
    torch.testing.assert_close(ours, ref)


def test_every_bench_step_scenario_is_a_model_afd_builds():
    """bench-step's models for each family: configs afd reads, halves it builds, and FFN halves the weight
    prefetch and the expert metrics can read."""
    import torch

    from afd.backend import get_backend
    from afd.bench.step import SCENARIOS
    from afd.dataplane.prefetch import PrefetchConfig, PrefetchSchedule
    from afd.model.checkpoint import DummyReader, build_attention_half, build_ffn_half
    from afd.model.registry import config_from_hf

    for name, raw in SCENARIOS.items():
        cfg = config_from_hf(raw)
        assert cfg.moe_layers, name
        build_attention_half(cfg, DummyReader(0), torch.float32, torch.device("cpu"))
        ffn = build_ffn_half(cfg, DummyReader(0), torch.float32, torch.device("cpu"))
        # what every family's FFN half must offer the weight prefetch and the metrics (registry contract)
        schedule = PrefetchSchedule(ffn, get_backend("cpu"), PrefetchConfig(enabled=True, budget_bytes=1 << 16))
        assert all(schedule(layer) > 0 for layer in cfg.moe_layers), name
        assert all(len(ffn.layer(i).experts.last_counts) == cfg.n_routed_experts for i in cfg.moe_layers)
