"""Hardware specs (afd/plan/hardware.py) and the roofline that turns one into a CostModel (afd/plan/roofline.py):
loading and its errors, the roofline's limits (memory-bound at one token, compute-bound at many), what
quantization changes, and the published-figure checks' per-layer tables (printed; run with -s to see them)."""

from __future__ import annotations

import pytest
import yaml

from afd.model.registry import config_from_hf
from afd.plan.costs import CostModel
from afd.plan.hardware import SPECS_DIR, SpecError, available_specs, load_spec, parse_spec
from afd.plan.roofline import roofline
from afd.plan.roofline_ops import experts_touched

# LongCat-Flash-Chat's config.json (meituan-longcat/LongCat-Flash-Chat on the Hugging Face hub), as published;
# transformers' LongcatFlashConfig defaults are the same values. qk_rope_head_dim 64 (= head_dim) is what HF's
# port and afd read; the remote-code configuration file's own default differs (128), its config.json does not.
LONGCAT_FLASH = {
    "model_type": "longcat_flash",
    "hidden_size": 6144,
    "num_layers": 28,
    "num_attention_heads": 64,
    "ffn_hidden_size": 12288,
    "expert_ffn_hidden_size": 2048,
    "n_routed_experts": 512,
    "zero_expert_num": 256,
    "moe_topk": 12,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 131072,
    "max_position_embeddings": 131072,
}
DEEPSEEK_V3 = {"model_type": "deepseek_v3"}  # HF's DeepseekV3Config defaults are DeepSeek-V3's config.json


def _spec(**changes) -> dict:
    """h200.yaml's dict with dotted-key changes (None deletes)."""
    d = yaml.safe_load((SPECS_DIR / "h200.yaml").read_text())
    for key, v in changes.items():
        *path, last = key.split("__")
        node = d
        for k in path:
            node = node[k]
        if v is None:
            node.pop(last)
        else:
            node[last] = v
    return d


def _flat(launch_us: float = 0.0):
    """A spec with round peaks: bf16 100 TFLOPS, fp8 200, 1 TB/s, no launch cost unless asked."""
    d = _spec(compute_tflops={"bf16": 100, "fp8": 200}, memory={"bandwidth_tb_s": 1, "capacity_gb": 80})
    d["launch_overhead_us"] = launch_us
    return parse_spec(d, "flat")


def test_shipped_specs_load_by_name_and_path():
    assert {"a3", "h200"} <= set(available_specs())
    for name in ("a3", "h200"):
        by_name, by_path = load_spec(name), load_spec(str(SPECS_DIR / f"{name}.yaml"))
        assert by_name == by_path and by_name.name == name
    h200, a3 = load_spec("h200"), load_spec("a3")
    assert h200.flops("fp8") == 2 * h200.flops("bf16") and h200.memory_bandwidth == 4.8e12
    with pytest.raises(SpecError, match="no fp8"):
        a3.flops("fp8")
    with pytest.raises(SpecError, match="unknown hardware 'b200'.*a3"):
        load_spec("b200")


def test_a_spec_file_is_read_from_any_path(tmp_path):
    p = tmp_path / "mine.yml"
    p.write_text(yaml.safe_dump(_spec(name="mine")))
    assert load_spec(str(p)).name == "mine"


@pytest.mark.parametrize(
    "changes, error",
    [
        ({"memory__bandwith_tb_s": 4.8}, r"memory\.bandwith_tb_s: unknown key"),
        ({"colour": "green"}, r"colour: unknown key"),
        ({"memory__bandwidth_tb_s": -4.8}, r"memory\.bandwidth_tb_s must be positive, got -4\.8"),
        ({"links__inter_node__latency_us": "fast"}, r"links\.inter_node\.latency_us must be a number"),
        ({"links__intra_node": None}, r"links\.intra_node is missing"),
        ({"compute_tflops__bf16": None}, r"compute_tflops\.bf16 is missing"),
        ({"sources__links.inter_node.latency_us": None}, r"links\.inter_node\.latency_us has no source"),
        ({"sources__memory.latency": "x"}, r"sources\.memory\.latency: names no figure"),
        ({"sources__memory": ""}, r"sources\.memory must be a URL"),
    ],
)
def test_bad_specs_name_the_key(changes, error):
    with pytest.raises(SpecError, match=error):
        parse_spec(_spec(**changes), "bad.yaml")


def test_experts_touched():
    assert experts_touched(1, 64) == 1.0 and experts_touched(0, 64) == 0.0
    assert experts_touched(64, 64) == pytest.approx(64 * (1 - (63 / 64) ** 64))  # ~ 63 % of them
    assert experts_touched(10_000, 64) == pytest.approx(64)


def test_memory_bound_at_one_token():
    """One token: each piece reads its weights once; time ~ weight bytes / bandwidth (plus the few KB the
    token and, here, no KV cache add)."""
    spec = _flat()
    rf = roofline(spec, config_from_hf(DEEPSEEK_V3), context=0, ffn_nodes=8)
    assert rf.time("attn_pre", 1) == pytest.approx(rf.held_bytes("attn_pre") / 1e12, rel=0.01)
    assert rf.bound("attn_pre", 1) == "memory"
    ffn = rf.pieces["ffn"]
    one_expert = sum(op.weight_bytes / op.experts for op in ffn if op.experts)  # one row touches one expert
    assert rf.time("ffn", 1) == pytest.approx(one_expert / 1e12, rel=0.01)
    assert "router" in [op.name for op in rf.pieces["attn_pre"]]  # routing attention: 8 FFN nodes' default
    routed = roofline(spec, config_from_hf(DEEPSEEK_V3), context=0, ffn_nodes=8, routing="ffn")
    router = next(op.weight_bytes for op in routed.pieces["ffn"] if op.name == "router")
    assert routed.time("ffn", 1) == pytest.approx((one_expert + router) / 1e12, rel=0.01)


def test_compute_bound_at_many_rows():
    """Every local expert touched, the FFN line's slope is its FLOPs per row over the peak."""
    cfg = config_from_hf(DEEPSEEK_V3)
    rf = roofline(_flat(), cfg, ffn_nodes=8)
    slope = (rf.time("ffn", 200_000) - rf.time("ffn", 100_000)) / 100_000
    expert_flops = 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert slope == pytest.approx(expert_flops / 100e12, rel=0.1)
    assert rf.bound("ffn", 100_000) == "compute"
    fp8 = roofline(_flat(), cfg, ffn_nodes=8, quantization="fp8")  # twice the peak: about half the slope
    assert (fp8.time("ffn", 200_000) - fp8.time("ffn", 100_000)) / 100_000 == pytest.approx(slope / 2, rel=0.1)


def test_fp8_halves_weight_bytes():
    cfg = config_from_hf(DEEPSEEK_V3)
    bf16, fp8 = (roofline(load_spec("h200"), cfg, quantization=q) for q in (None, "fp8"))
    for piece in ("attn_pre", "attn_window", "ffn"):
        for a, b in zip(bf16.pieces[piece], fp8.pieces[piece]):
            if a.compute in ("bf16",) and b.compute == "fp8":  # the quantized GEMMs
                assert b.weight_bytes == a.weight_bytes / 2
    experts = [op.weight_bytes for op in fp8.pieces["ffn"] if op.experts]
    assert sum(experts) == sum(op.weight_bytes for op in bf16.pieces["ffn"] if op.experts) / 2
    with pytest.raises(SpecError, match="no fp8 compute.*cannot run there"):
        roofline(load_spec("a3"), cfg, quantization="fp8")
    roofline(load_spec("a3"), cfg, quantization="w8a8")  # int8 GEMMs: A3's quantization


def test_cost_model_round_trips_json():
    rf = roofline(load_spec("h200"), config_from_hf(DEEPSEEK_V3), quantization="fp8", ffn_nodes=8)
    cm = rf.cost_model()
    assert cm.source == "hardware h200" and cm.link.bandwidth == 50e9
    assert cm.dense_layer.slope > 0 and cm.moe_layer.attn_window.slope > 0
    assert CostModel.from_json(cm.to_json()) == cm


def test_fit_errors_are_honest():
    """A line fits a piece's roofline well where the kernels keep one bound; the FFN's touched experts
    saturate (a knee), and a line across the knee says so in its rel_err."""
    rf = roofline(load_spec("h200"), config_from_hf(DEEPSEEK_V3), quantization="fp8", ffn_nodes=32)
    tokens = (64, 128, 256, 512, 1024)
    for toks, knee in ((tokens, False), ((4, 8, 16, 32, 64, 128), True)):
        cm = rf.cost_model(toks)
        rows = [t * rf.rows_per_token for t in toks]
        worst = max(abs(cm.moe_layer.ffn(r) - rf.time("ffn", r)) / rf.time("ffn", r) for r in rows)
        assert cm.moe_layer.ffn.rel_err == pytest.approx(worst)
        assert (worst > 0.2) == knee
    assert cm.moe_layer.attn_pre.rel_err < 0.01  # weights and KV reads: linear in tokens


@pytest.mark.parametrize("family", [LONGCAT_FLASH, DEEPSEEK_V3])
def test_tp_collectives_send_tp_volume_bytes(family):
    """Attention TP's all-reduces and gathers carry afd.model.tp.volume's bytes (tp_comm allreduce)."""
    from afd.config.tp import TPConfig
    from afd.model.tp.volume import volume

    cfg, T, G = config_from_hf(family), 64, 8
    rf = roofline(load_spec("a3"), cfg, attn_tp=G)
    v = volume(cfg, TPConfig(size=G), T, 2)

    def sent(pieces):
        return sum(op.link_bytes_per_x * T for piece in pieces for op in rf.pieces[piece])

    assert sent(("attn_pre", "attn_window", "attn_post")) == pytest.approx(sum(v.moe_layer.values()))
    if cfg.moe_layers[0] > 0:
        assert sent(("dense",)) == pytest.approx(sum(v.dense_layer.values()))
    step = volume(cfg, TPConfig(size=G), T, 2, seqs=T).step  # decode: every token a sequence's last
    assert sent(("step",)) == pytest.approx(sum(step.values()))
    hop = next(op for op in rf.pieces["attn_pre"] if op.link_hops)
    assert rf.op_time(hop, T) == (hop.link_bytes_per_x * T / 196e9 + 14 * 1e-6 + 10e-6, "link")
    with pytest.raises(ValueError, match="GQA half has no TP"):
        roofline(load_spec("a3"), config_from_hf({"model_type": "qwen3_moe"}), attn_tp=2)


def test_gqa_family():
    cfg = config_from_hf({"model_type": "qwen3_moe", "mlp_only_layers": [0]})
    rf = roofline(load_spec("h200"), cfg, context=1024)
    assert rf.time("dense", 8) > rf.time("attn_pre", 8) > 0 and not rf.pieces["attn_window"]


def test_longcat_flash_on_a3(capsys):
    """The issue's A3 check, per layer: LongCat-Flash W8A8, 32 FFN dies (16 experts each), graph-mode launch.
    The ScMoE window (two dense MLPs and the second attention) outweighs attention before the exchange."""
    rf = roofline(load_spec("a3"), config_from_hf(LONGCAT_FLASH), quantization="w8a8", ffn_nodes=32, launch=1e-6)
    assert rf.rows_per_token == 8 * 16 / 512  # 12 picks, 512 of 768 router outputs real experts
    with capsys.disabled():
        print("\nLongCat-Flash on a3 (us per layer; rows: per FFN die, one attention die's tokens)")
        print(rf.describe([1, 16, 64, 128, 256]))
    for x in (1, 64, 256):
        assert rf.time("attn_window", x) > rf.time("attn_pre", x)
        assert rf.bound("attn_pre", x) == "memory"


def test_deepseek_v3_on_h200_large_batch(capsys):
    """The issue's H200 check, per layer: DeepSeek-V3 FP8, 32 FFN GPUs (8 experts each). At large batch the
    absorbed MLA turns compute-bound while an FFN GPU stays memory-bound until ~200 rows per expert."""
    rf = roofline(load_spec("h200"), config_from_hf(DEEPSEEK_V3), quantization="fp8", ffn_nodes=32, launch=1e-6)
    with capsys.disabled():
        print("\nDeepSeek-V3 on h200 (us per layer; rows: per FFN GPU, one attention GPU's tokens)")
        print(rf.describe([64, 256, 1024]))
    assert rf.bound("attn_pre", 1024) == "compute"
    assert rf.bound("ffn", 256) == "memory" and rf.bound("ffn", 8 * 400) == "compute"


def test_the_simulator_takes_a_roofline_cost_model():
    """A spec-derived CostModel stands where a profiled one does: LongCat-Flash on a3, 2 attention nodes of TP8
    and 32 FFN dies, 16 sequences each in 2 micro-batches, fitted around the sizes that layout gives."""
    from afd.plan.scenario import Scenario
    from afd.plan.shape import Layout, ModelShape
    from afd.plan.simulate import simulate

    cfg = config_from_hf(LONGCAT_FLASH)
    rf = roofline(load_spec("a3"), cfg, quantization="w8a8", ffn_nodes=32, attn_tp=8, launch=1e-6)
    b, rows = 8, 2 * 8 * rf.rows_per_token  # tokens per micro-batch; rows per FFN die: A * b * rows_per_token
    cm = rf.cost_model(tokens=(b / 2, b, 2 * b), rows=(rows / 2, rows, 2 * rows))
    p = simulate(Scenario(ModelShape.from_config(cfg), Layout(2, 32, 16, 2, 8, routing="attention"), cm))
    per_layer = sum(rf.time(piece, b) for piece in ("attn_pre", "attn_window", "attn_post"))
    assert p.step_time >= p.attention_busy >= 2 * cfg.num_layers * per_layer * 0.9
