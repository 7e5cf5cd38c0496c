"""afd.plan.simulate against cases whose step time follows by hand: no overlap, a hidden exchange, an
FFN-bound cluster; the inputs' checks; bytes against the data plane's formulas. Pure Python, fast."""

from __future__ import annotations

import json
from math import comb

import pytest

from afd.config.placement import default_placement, expected_fanout
from afd.model.demo_config import DEMO_CONFIG
from afd.plan.costs import CostModel, LayerCosts, Linear, Link
from afd.plan.scenario import Scenario
from afd.plan.shape import Layout, ModelShape
from afd.plan.simulate import program, simulate

# 3 MoE layers, hidden 256 in float32, top-4 of 16 routed experts, no identity experts
SHAPE = ModelShape(3, (0, 1, 2), 256, 4, 16, dtype="float32", name="test")


def costs(
    pre=(1e-5, 1e-3),
    window=(0.0, 0.0),
    post=(0.0, 2e-4),
    ffn=(1e-6, 5e-4),
    dense=(0.0, 0.0),
    overhead=(0.0, 0.0),
    latency=1e-4,
    bandwidth=1e9,
) -> CostModel:
    """(slope per token or row, intercept) seconds for each piece."""
    return CostModel(
        "test",
        "test",
        "float32",
        LayerCosts(Linear(*pre), Linear(*window), Linear(*post), Linear(*ffn)),
        Linear(*dense),
        Linear(*overhead),
        Link(latency, bandwidth),
    )


def run(layout: Layout, c: CostModel, shape: ModelShape = SHAPE):
    return simulate(Scenario(shape, layout, c))


def test_no_overlap_1a1f_is_the_sum_of_every_piece():
    c = costs(window=(2e-6, 3e-4), overhead=(1e-6, 2e-3))
    B = 8
    p = run(Layout(1, 1, B, overlap=False), c)
    msg = B * 256 * 4  # float32 hidden of every token, each way
    rows = B * 4  # every token's 4 experts on the one FFN node
    m = c.moe_layer
    layer = m.attn_pre(B) + c.link(msg) + m.ffn(rows) + c.link(msg) + m.attn_window(B) + m.attn_post(B)
    assert p.step_time == pytest.approx(c.step_overhead(B) + 3 * layer, rel=1e-12)
    assert p.tpot == p.step_time
    assert p.attention_wait == pytest.approx(3 * (2 * c.link(msg) + m.ffn(rows)), rel=1e-12)
    assert p.bytes_to_ffn == p.bytes_to_attention == 3 * msg


def test_overlap_1a1f_hides_the_exchange_behind_the_window():
    c = costs(window=(0.0, 4e-4))
    B = 8
    p = run(Layout(1, 1, B), c)
    m = c.moe_layer
    away = 2 * c.link(B * 256 * 4) + m.ffn(B * 4)
    assert p.step_time == pytest.approx(3 * (m.attn_pre(B) + max(m.attn_window(B), away) + m.attn_post(B)))
    assert p.attention_wait == pytest.approx(3 * max(0.0, away - m.attn_window(B)))


def test_a_dense_layer_runs_on_the_attention_side_alone():
    shape = ModelShape(4, (1, 2, 3), 256, 4, 16, dtype="float32")
    c = costs(dense=(1e-5, 7e-4))
    with_dense, without = run(Layout(1, 1, 8, overlap=False), c, shape), run(Layout(1, 1, 8, overlap=False), c)
    assert with_dense.step_time == pytest.approx(without.step_time + c.dense_layer(8))


def test_ping_pong_hides_a_free_exchange_completely():
    """A free link and a near-instant FFN: with m = 2 the step is the attention side's work alone."""
    c = costs(ffn=(0.0, 1e-9), latency=0.0, bandwidth=1e18, window=(0.0, 1e-4), overhead=(0.0, 1e-3))
    p = run(Layout(1, 1, 16, micro_batches=2), c)
    assert p.step_time == pytest.approx(p.attention_busy, rel=1e-9)
    assert p.attention_wait == pytest.approx(0.0, abs=1e-12)
    assert p.bottleneck == "attention"


def test_ping_pong_hides_a_slow_link_that_one_micro_batch_exposes():
    c = costs(latency=3e-4)  # no window: with m = 1 every layer waits for the round trip
    one, two = run(Layout(1, 1, 16), c), run(Layout(1, 1, 16, micro_batches=2), c)
    assert one.attention_wait > 3 * 2 * 3e-4
    # m = 2: only the last layer's second micro-batch still waits for part of its round trip
    assert two.attention_wait < 2 * c.link(8 * 256 * 4) + c.moe_layer.ffn(8 * 4)
    assert two.step_time == pytest.approx(two.attention_busy + two.attention_wait)


def test_an_ffn_bound_step_is_the_ffn_time_per_layer():
    c = costs(pre=(0.0, 1e-6), post=(0.0, 1e-6), ffn=(1e-3, 0.0), latency=1e-7)
    for mb in (1, 2):
        p = run(Layout(2, 1, 16, micro_batches=mb), c)
        ffn = 3 * sum(c.moe_layer.ffn(2 * (16 // mb) * 4) for _ in range(mb))
        assert p.step_time == pytest.approx(ffn, rel=0.01)
        assert p.ffn_busy == pytest.approx(ffn)
        assert p.bottleneck == "ffn" and p.ffn_idle_share < 0.01


def test_attention_nodes_raise_the_ffn_rows_linearly():
    c = costs(ffn=(1e-5, 0.0))
    rows = {A: Scenario(SHAPE, Layout(A, 2, 12), c).ffn_rows(0) for A in (1, 2, 4, 8)}
    assert rows == {A: A * 12 * 4 / 2 for A in rows}
    busy = {A: run(Layout(A, 2, 12), c).ffn_busy for A in (1, 2, 4)}
    assert busy[2] == pytest.approx(2 * busy[1]) and busy[4] == pytest.approx(4 * busy[1])


@pytest.mark.parametrize("F", [2, 4])
def test_dispatch_sends_fewer_bytes_than_broadcast(F):
    c = costs()
    broadcast = run(Layout(1, F, 16, routing="ffn"), c)
    dispatch = run(Layout(1, F, 16, routing="attention"), c)
    assert dispatch.bytes_to_ffn < broadcast.bytes_to_ffn
    assert dispatch.bytes_to_attention < broadcast.bytes_to_attention
    assert broadcast.bytes_to_ffn == 3 * F * 16 * 256 * 4  # every token to every node


def test_dispatch_bytes_follow_the_expected_fanout():
    s = Scenario(SHAPE, Layout(1, 4, 16, routing="attention"), costs())
    fan = expected_fanout(default_placement(16, [f"f{i}" for i in range(4)]), 4)
    sizes, back = s.messages(0)
    assert sizes[0] == 8  # the count
    assert sizes[1] == pytest.approx(16 * fan * (256 * 4 + 8 * 4) / 4)
    assert back == pytest.approx(16 * fan * 256 * 4 / 4)


def test_identity_picks_cross_nowhere():
    """LongCat-Flash's shape (the demo's): 16 routed + 4 identity experts, top-4. The fan-out is that of
    the routed picks alone (hypergeometric over how many of the 4 are routed), and so are the FFN rows."""
    shape = ModelShape.from_hf(DEMO_CONFIG)
    assert (shape.identity_experts, shape.dtype, shape.moe_layers) == (4, "float32", (0, 1, 2, 3))
    s = Scenario(shape, Layout(1, 2, 10, routing="attention"), costs())
    p = default_placement(16, ["f0", "f1"])
    want = sum(comb(16, k) * comb(4, 4 - k) / comb(20, 4) * expected_fanout(p, k) for k in range(5))
    assert s.fanout == pytest.approx(want)
    assert s.ffn_rows(0) == pytest.approx(10 * 4 * 16 / 20 / 2)


def test_a_shape_from_a_checkpoint_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEMO_CONFIG | {"dtype": "bfloat16"}))
    shape = ModelShape.from_model(str(tmp_path))
    assert shape == ModelShape(4, (0, 1, 2, 3), 256, 4, 16, 4, (1, 1), "bfloat16", str(tmp_path))
    assert ModelShape.from_model(str(tmp_path), dtype="float32").dtype == "float32"


def test_quantized_exchange_shrinks_what_goes_to_the_ffn_only():
    same, fp8 = (Scenario(SHAPE, Layout(1, 1, 8, exchange_dtype=d), costs()).messages(0) for d in ("same", "fp8"))
    assert fp8[0] == (8 * (256 + 4),) and same[0] == (8 * 256 * 4,)
    assert fp8[1] == same[1]


def test_attention_tp_splits_the_rows_each_rank_sends():
    one, two = (Scenario(SHAPE, Layout(1, 2, 8, attention_tp=g), costs()) for g in (1, 2))
    assert two.messages(0)[0][0] == one.messages(0)[0][0] / 2
    assert two.ffn_rows(0) == one.ffn_rows(0)
    assert run(Layout(1, 2, 8, attention_tp=2), costs()).devices == 4


@pytest.mark.parametrize("routing", ["ffn", "attention"])
def test_one_rank_stands_for_all(routing):
    c = costs(window=(1e-6, 1e-4), latency=2e-4, overhead=(0.0, 1e-3))
    s = Scenario(SHAPE, Layout(3, 2, 9, micro_batches=2, attention_tp=2, routing=routing), c)
    assert simulate(s, explicit=True) == simulate(s)


def test_a_cost_model_round_trips_through_json():
    c = costs(window=(1e-6, 1e-4), dense=(2e-6, 3e-4), overhead=(1e-7, 1e-3))
    back = CostModel.from_json(c.to_json())
    assert back == c
    assert run(Layout(2, 2, 8, micro_batches=2), back) == run(Layout(2, 2, 8, micro_batches=2), c)


def test_the_program_is_the_runners_order():
    s = Scenario(ModelShape(2, (0, 1), 256, 4, 16), Layout(1, 1, 4, micro_batches=2), costs())
    assert program(s) == [
        ("pre", 0, 0), ("pre", 0, 1),
        ("window", 0, 0), ("wait", 0, 0), ("post", 0, 0), ("pre", 1, 0),
        ("window", 0, 1), ("wait", 0, 1), ("post", 0, 1), ("pre", 1, 1),
        ("window", 1, 0), ("wait", 1, 0), ("post", 1, 0),
        ("window", 1, 1), ("wait", 1, 1), ("post", 1, 1),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(batch=1, micro_batches=2), "batch 1 < micro_batches 2"),
        (dict(ffn_nodes=0), "ffn_nodes must be >= 1"),
        (dict(attention_nodes=0), "attention_nodes must be >= 1"),
        (dict(micro_batches=0), "micro_batches must be >= 1"),
        (dict(micro_batches=5, batch=8), "at most 4"),
        (dict(attention_tp=0), "attention_tp must be >= 1"),
        (dict(routing="dispatch"), "routing 'dispatch'"),
        (dict(exchange_dtype="bf16"), "exchange_dtype 'bf16'"),
    ],
)
def test_bad_layouts_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Layout(**({"attention_nodes": 1, "ffn_nodes": 1, "batch": 4} | kwargs))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(moe_layers=(3,)), "not one of the 3 layers"),
        (dict(moe_layers=()), "moe_layers is empty"),
        (dict(moe_layers=(1, 0)), "ascending"),
        (dict(experts_per_token=17), "exceeds"),
        (dict(hidden_size=0), "hidden_size must be >= 1"),
        (dict(dtype="int8"), "dtype 'int8'"),
        (dict(expert_groups=(3, 1)), "do not divide"),
    ],
)
def test_bad_shapes_are_refused(kwargs, message):
    base = dict(num_layers=3, moe_layers=(0, 1, 2), hidden_size=256, experts_per_token=4, n_routed_experts=16)
    with pytest.raises(ValueError, match=message):
        ModelShape(**(base | kwargs))


def test_more_ffn_nodes_than_experts_is_refused():
    with pytest.raises(ValueError, match="17 FFN nodes for 16 routed experts"):
        Scenario(SHAPE, Layout(1, 17, 4), costs())
