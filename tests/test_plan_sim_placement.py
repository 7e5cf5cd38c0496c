"""afd.plan.simulate on a placement that is not even, on a cluster YAML's layout and on the released
models' shapes: the busiest FFN node sets an FFN-bound step, deploy/1a2f.yaml's 10/6 split is the one
simulated, a group-limited router bounds the fan-out. Pure Python, fast."""

from __future__ import annotations

import pytest

from afd.config.loader import load
from afd.config.placement import Placement, from_yaml
from afd.model.demo_config import DEMO_CONFIG
from afd.plan.scenario import Scenario
from afd.plan.shape import Layout, ModelShape
from afd.plan.simulate import simulate
from tests.test_plan_simulate import SHAPE, costs

UNEVEN = from_yaml({"ffn0": "0-9", "ffn1": "10-15"}, 16, ["ffn0", "ffn1"])


def test_an_uneven_placement_loads_its_bigger_node_more():
    s = Scenario(SHAPE, Layout(2, 2, 8, routing="attention"), costs(), UNEVEN)
    assert s.ffn_rows(0, 0) == pytest.approx(2 * 8 * 4 * 10 / 16)
    assert s.ffn_rows(0, 1) == pytest.approx(2 * 8 * 4 * 6 / 16)
    assert s.node_fanout[0] > s.node_fanout[1]
    assert s.messages(0, 0)[1] > s.messages(0, 1)[1]


@pytest.mark.parametrize("routing", ["ffn", "attention"])
def test_the_busiest_ffn_node_sets_an_ffn_bound_step(routing):
    c = costs(pre=(0.0, 1e-6), post=(0.0, 1e-6), ffn=(1e-3, 0.0), latency=1e-7)
    lay = Layout(1, 2, 16, routing=routing)
    even, uneven = simulate(Scenario(SHAPE, lay, c)), simulate(Scenario(SHAPE, lay, c, UNEVEN))
    assert uneven.ffn_busy == pytest.approx(3 * c.moe_layer.ffn(16 * 4 * 10 / 16))
    assert uneven.step_time == pytest.approx(even.step_time * 10 / 8, rel=0.01)
    assert simulate(Scenario(SHAPE, lay, c, UNEVEN), explicit=True) == uneven


def test_replicas_split_their_expert_and_need_dispatch():
    replicated = Placement(16, ("ffn0", "ffn1"), (tuple(range(0, 9)), tuple(range(8, 16))))  # expert 8 on both
    s = Scenario(SHAPE, Layout(1, 2, 8, routing="attention"), costs(), replicated)
    assert s.node_share == pytest.approx((8.5 / 16, 7.5 / 16))
    with pytest.raises(ValueError, match="routing 'attention'"):
        Scenario(SHAPE, Layout(1, 2, 8, routing="ffn"), costs(), replicated)
    with pytest.raises(ValueError, match="not 3 and 16"):
        Scenario(SHAPE, Layout(1, 3, 8), costs(), replicated)


def test_a_cluster_yaml_is_simulated_as_written():
    cfg = load("deploy/1a2f.yaml")
    shape = ModelShape.from_hf(DEMO_CONFIG)
    s = Scenario.from_cluster(cfg, shape, costs(), batch=8, micro_batches=2)
    assert s.layout == Layout(1, 2, 8, 2, 1, True, "attention", "same")
    assert s.placement == UNEVEN
    with pytest.raises(ValueError, match="layout.micro_batches is 0"):
        Layout.from_cluster(cfg, batch=8)
    assert simulate(s).step_time > 0


@pytest.mark.parametrize(
    "model_type, moe, groups",
    [("deepseek_v3", 58, (8, 4)), ("qwen3_moe", 24, (1, 1)), ("longcat_flash", 28, (1, 1))],
)
def test_released_shapes_from_their_families_defaults(model_type, moe, groups):
    """HF's defaults per family (afd/model/<family>/config.py): DeepSeek-V3's first 3 layers are dense and
    its router keeps 4 of 8 groups, so at 8 FFN nodes (a group each) a token reaches at most 4 of them."""
    shape = ModelShape.from_hf({"model_type": model_type, "vocab_size": 1000, "dtype": "bfloat16"})
    assert (len(shape.moe_layers), shape.expert_groups, shape.routed_per_token) == (moe, groups, 8.0)
    s = Scenario(shape, Layout(1, 8, 16, routing="attention"), costs())
    assert 1 < s.fanout <= (4 if groups[0] > 1 else 8)
    assert simulate(s).bytes_to_ffn < simulate(Scenario(shape, Layout(1, 8, 16), costs())).bytes_to_ffn
