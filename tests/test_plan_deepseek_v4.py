"""`afd plan` for DeepSeek-V4 (afd/plan/roofline_v4.py): the roofline holds the weights the model holds, reads
the state its layer types read, and the search routes on the attention side (its hash router reads the token
ids), at one FFN node too."""

from __future__ import annotations

import json

import pytest
import torch
from hf_deepseek_v4 import BASE, CSA, HCA, SWA

from afd.config.loader import load
from afd.entrypoints.cli import main
from afd.model.registry import config_from_hf
from afd.plan.hardware import load_spec
from afd.plan.roofline import roofline

# what the roofline leaves out of a layer's weights: norms' gains and the per-head and per-slot vectors
# (elementwise kernels' operands, a few values per row), as it does for every family
NOT_GEMM = ("norm.weight", ".ape", "attn_sink", ".base", ".scale")


def _config_json(**changes) -> dict:
    from transformers import DeepseekV4Config

    d = DeepseekV4Config(**{**BASE, **changes}).to_dict()
    return d | {"architectures": ["DeepseekV4ForCausalLM"]}


def test_the_rooflines_weights_are_the_attention_halfs():
    """The layers' weights a roofline charges (bf16 linears, the fp32 mHC projections) are the parameters of
    afd's own attention half, counted on the meta device: every layer type, the indexer, the compressors and
    the grouped wo_a included, and the router (routing attention). The pieces are the mean layer, so L of them
    hold the whole."""
    from afd.model.deepseek_v4.attention import AttentionHalf

    cfg = config_from_hf(_config_json())
    with torch.device("meta"):
        half = AttentionHalf(cfg)
    want = 0
    for name, param in half.layers.named_parameters():
        if not name.endswith(NOT_GEMM):
            want += param.numel() * (4 if name.split(".")[1].startswith("hc_") else 2)  # mHC: fp32
    want += cfg.num_hidden_layers * cfg.n_routed_experts * cfg.hidden_size * 2  # the router, routed here
    r = roofline(load_spec("h200"), cfg, dtype="bfloat16", context=64)
    held = cfg.num_hidden_layers * sum(r.held_bytes(p) for p in ("attn_pre", "attn_window", "attn_post"))
    assert held == pytest.approx(want, rel=1e-12)


def test_each_layer_type_reads_its_own_state():
    """Past the window, a sliding-window layer reads no more as the context grows; an HCA layer reads one
    entry per hca_rate positions (memory-bound at one token: exactly its bytes over the bandwidth); a CSA
    layer's indexer scores every entry while its attention reads at most index_topk of them."""
    spec = load_spec("h200")
    D, W, r = BASE["head_dim"], BASE["sliding_window"], BASE["compress_rates"][HCA]

    def pre(kind: str, context: int) -> float:
        cfg = config_from_hf(_config_json(layer_types=[kind] * 4))
        return roofline(spec, cfg, dtype="bfloat16", context=context).time("attn_pre", 1)

    assert pre(SWA, W) == pre(SWA, 100 * W)
    grown = pre(HCA, 64 * r) - pre(HCA, 32 * r)  # 32 more entries of D values, 2 bytes each
    assert grown == pytest.approx(32 * D * 2 / spec.memory_bandwidth, rel=1e-9)
    assert pre(CSA, 4096) > pre(CSA, 2048) > pre(SWA, 4096)


def test_routing_ffn_is_refused_for_the_hash_router():
    cfg = config_from_hf(_config_json())
    with pytest.raises(ValueError, match="reads the token ids"):
        roofline(load_spec("h200"), cfg, routing="ffn")
    assert "routing attention" in roofline(load_spec("h200"), cfg).notes[0]


def test_plan_routes_on_the_attention_side_and_writes_a_yaml_check_config_accepts(tmp_path, capsys):
    model = tmp_path / "v4"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(_config_json()))
    out = tmp_path / "plan.yaml"
    argv = ["plan", "--model", str(model), "--hardware", "h200", "--tpot-slo", "5", "--devices", "4", "--top", "50"]
    assert main([*argv, "--output", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["A", "TP"])
    rows = [line.split() for line in lines[head + 1 :] if line.strip() and line.split()[0].isdigit()]
    assert rows and {r[5] for r in rows} == {"attention"} and {r[1] for r in rows} == {"1"}
    assert "1" in {r[2] for r in rows}  # one FFN node, still routed on the attention side
    assert load(str(out)).routing == "attention"
    assert main(["check-config", str(out)]) == 0


@pytest.mark.slow  # a 1A1F cluster of node processes, about 30 s
@pytest.mark.multiprocess
def test_profile_measures_v4_routed_on_the_attention_side(tmp_path):
    """`afd profile` ran its cluster under routing ffn as well, which V4's hash router refuses: it now runs the
    one cluster, routed on the attention side, and takes both submits from it."""
    from hf_deepseek_v4 import V4_CONFIGS, make_v4_checkpoint

    from afd.cluster.local_config import local_config
    from afd.plan.profile import profile

    path = make_v4_checkpoint(str(tmp_path / "v4"), **V4_CONFIGS["all_types"])
    yaml_path = tmp_path / "v4.yaml"
    cfg = local_config(1, 1, {"model": {"path": path}, "layout": {"routing": "attention"}}, name="v4", device="cpu")
    yaml_path.write_text(cfg.to_yaml())
    kw = dict(context=16, steps=3, repeats=1, link_repeats=5, link_sizes=(64, 4096), log=lambda _: None)
    m, model = profile(str(yaml_path), (1, 2, 4), **kw)
    assert [c["batch"] for c in m.cluster] == [1, 2, 4] and all(c["step"] > 0 for c in m.cluster)
    assert any("its router reading the token ids" in n for n in model.notes)
    assert model.submit == model.submit_dispatch and model.submit(4) > 0
    assert model.moe_layer.ffn.points == 3 and model.moe_layer.attn_pre(4) > 0
