"""afd.plan.simulate with the host's cores shared (CostModel.host_cores): a CPU profile's plans run every node
process on one host, so more processes than cores slow each other. Pure Python, fast."""

from __future__ import annotations

import dataclasses
import types

import pytest

from afd.plan.costs import CostModel, LayerCosts, Linear
from afd.plan.profile_fit import message_cpu
from afd.plan.shape import Layout
from afd.plan.simulate import Timeline
from tests.test_plan_simulate import SHAPE, costs, run


def with_cores(c: CostModel, n: int) -> CostModel:
    return dataclasses.replace(c, host_cores=n)


def test_enough_cores_change_nothing():
    c = costs(window=(2e-6, 3e-4), overhead=(1e-6, 2e-3))
    for lay in (Layout(1, 1, 8, overlap=False), Layout(2, 1, 8, micro_batches=2), Layout(1, 2, 8)):
        shared = dataclasses.replace(run(lay, with_cores(c, 3)), host_cpu=0.0, host_cores=0)
        assert shared == run(lay, c)  # 3 processes, 3 cores, no message CPU: the timeline is the bound


def test_one_core_serializes_every_compute_task():
    c = costs(window=(2e-6, 3e-4), latency=0.0, bandwidth=1e15)  # a free link: only compute counts
    lay = Layout(2, 1, 8, micro_batches=2)
    free, one = run(lay, c), run(lay, with_cores(c, 1))
    compute = 2 * free.attention_busy + free.ffn_busy  # every task of both ranks and the FFN node, end to end
    assert one.step_time == pytest.approx(compute, rel=1e-6)
    assert free.step_time < one.step_time
    assert one.attention_busy == free.attention_busy  # the work is the same; waiting for a core is not busy


def test_two_cores_for_three_processes_lie_between():
    c = costs(window=(2e-6, 3e-4))
    lay = Layout(2, 1, 8, overlap=True, micro_batches=2)
    free, two, one = run(lay, c), run(lay, with_cores(c, 2)), run(lay, with_cores(c, 1))
    assert free.step_time <= two.step_time <= one.step_time


def test_compute_tasks_share_the_cores_as_the_kernel_time_slices():
    """n compute tasks running at once on c < n cores each progress at c/n (processor sharing); a link's task
    needs no core; a task starts once its inputs have ended, and that wait is idle, not queued."""
    one = Timeline(cores=1)
    a, b = one.run("a", (), 1.0, core=True), one.run("b", (), 2.0, core=True)
    wire = one.run("link", (), 1.5)
    after = one.run("c", (a,), 0.5, core=True)
    one.solve()
    # [0, 1.5): a and b at half speed, a done at 2.0; then b and c share: c's 0.5 by 3.0, b's last 0.5 by 3.5
    assert one.end[a] == pytest.approx(2.0) and one.end[wire] == pytest.approx(1.5)
    assert one.start[after] == pytest.approx(2.0) and one.end[after] == pytest.approx(3.0)
    assert one.end[b] == pytest.approx(3.5) and one.finish == pytest.approx(3.5)
    assert one.queued["a"] == pytest.approx(1.0) and one.queued["b"] == pytest.approx(1.5)
    assert one.idle["c"] == pytest.approx(2.0) and one.queued["c"] == pytest.approx(0.5)
    two = Timeline(cores=2)
    ids = [two.run(r, (), 1.0, core=True) for r in "xyz"]
    two.solve()
    assert [two.end[k] for k in ids] == pytest.approx([1.5, 1.5, 1.5])  # 3 on 2 cores: 2/3 speed each
    alone = Timeline()
    ids = [alone.run(r, (), 1.0, core=True) for r in "xyz"]
    assert alone.solve().finish == 1.0  # no host cores: every node has its own device


def test_host_cores_round_trip_json_and_default():
    c = with_cores(costs(), 2)
    assert CostModel.from_json(c.to_json()).host_cores == 2
    assert CostModel.from_json(costs().to_json()).host_cores == 0
    c = dataclasses.replace(c, message_cpu=1e-4)
    assert CostModel.from_json(c.to_json()).message_cpu == 1e-4


def test_the_hosts_cpu_bounds_the_step():
    """Every process's CPU of a step must come from the host's cores: compute (attention ranks, FFN nodes) plus
    the messages' CPU, one message each way per MoE layer, micro-batch and (rank, node) pair."""
    c = costs(window=(2e-6, 3e-4))
    lay = Layout(1, 2, 8, overlap=True, micro_batches=2)
    free = run(lay, with_cores(c, 3))
    moe = len(SHAPE.moe_layers)
    assert free.host_cpu == pytest.approx(free.attention_busy + 2 * free.ffn_busy)
    busy = run(lay, with_cores(dataclasses.replace(c, message_cpu=1e-3), 3))
    messages = moe * 2 * 2 * 2  # layers x micro-batches x FFN nodes x both ways
    assert busy.host_cpu == pytest.approx(free.host_cpu + messages * 1e-3)
    assert busy.step_time == pytest.approx(busy.host_cpu / 3) and busy.step_time > free.step_time
    assert busy.bottleneck == "host CPU"
    device = run(lay, dataclasses.replace(c, message_cpu=1e-3))  # no shared host: the messages' CPU is free
    assert device.host_cpu == 0.0 and device.step_time == free.step_time


def test_ffn_message_is_paid_per_rank_on_the_ffn_node():
    c = costs(window=(2e-6, 3e-4))
    for lay in (Layout(1, 1, 8, micro_batches=2), Layout(2, 1, 8)):
        base, slow = run(lay, c), run(lay, dataclasses.replace(c, ffn_message=1e-4))
        passes = len(SHAPE.moe_layers) * lay.micro_batches
        assert slow.ffn_busy == pytest.approx(base.ffn_busy + passes * lay.attention_ranks * 1e-4)
    lay = Layout(1, 2, 8, routing="attention")  # routed there, its own measure of it
    base, slow = (
        run(lay, dataclasses.replace(c, ffn_message=1e-4)),
        run(lay, dataclasses.replace(c, ffn_message_dispatch=1e-4)),
    )
    assert base.ffn_busy == run(lay, c).ffn_busy
    assert slow.ffn_busy == pytest.approx(base.ffn_busy + len(SHAPE.moe_layers) * 1e-4)
    back = CostModel.from_json(dataclasses.replace(c, ffn_message=1e-4, ffn_message_dispatch=2e-4).to_json())
    assert (back.ffn_message, back.ffn_message_dispatch) == (1e-4, 2e-4)


def test_message_cpu_is_what_the_processes_spent_beyond_the_model():
    """afd profile's measure: CPU per step less what the cost model charges, over the step's messages."""
    layer = LayerCosts(Linear(0.0, 1e-3), Linear(0.0, 2e-3), Linear(0.0, 0.0))
    overhead = Linear(0.0, 1e-3)
    charged = 1e-3 + 2 * 3e-3 + 2 * 0.5e-3  # overhead, 2 MoE layers of attention, 2 FFN passes
    cluster = [{"batch": b, "ffn_seconds": 0.5e-3, "cpu_per_step": charged + 4 * x} for b, x in ((4, 1e-4), (8, 2e-4))]
    cluster.append({"batch": 16, "ffn_seconds": 0.5e-3, "cpu_per_step": charged + 4 * 3e-4})
    m = types.SimpleNamespace(cluster=cluster, moe_layers=2, dense_layers=0, attention_tp=1)
    assert message_cpu(m, layer, overhead, Linear(0.0, 0.0)) == pytest.approx(2e-4)  # the median of three
    m.cluster = [dict(cluster[0], cpu_per_step=charged / 2)]
    assert message_cpu(m, layer, overhead, Linear(0.0, 0.0)) == 0.0  # never negative


def test_a_message_is_delivered_once_a_core_is_free():
    """With message_cpu, each delivery is a task of the receiving process's transport thread (half a message's
    CPU) that needs a host core: on as many cores as processes it waits while both compute (ping-pong at 1A1F),
    on more cores it only adds its own time."""
    c = dataclasses.replace(costs(window=(1e-5, 1e-3), ffn=(1e-5, 2e-3), latency=1e-5), message_cpu=4e-4)
    lay = Layout(1, 1, 8, micro_batches=2)
    two, many = run(lay, with_cores(c, 2)), run(lay, with_cores(c, 8))
    plain = run(lay, dataclasses.replace(c, message_cpu=0.0))
    assert plain.step_time < many.step_time <= two.step_time
    assert two.step_time > many.step_time  # some delivery waited for a core both processes held
    assert run(lay, c).step_time == plain.step_time  # no shared host (a device per node): messages cost no core


def test_a_rendezvous_holds_routed_rows_until_the_node_posts_their_receive():
    """gloo sends a message's bytes once its receive is posted (CostModel.rendezvous): under routing attention
    the rows' receive waits for the count and for the FFN node to finish the micro-batch before, then the
    notice crosses back; its round costs the host CPU of one more message. Routing ffn's rows are posted
    ahead: nothing changes there."""
    c = dataclasses.replace(costs(window=(1e-5, 1e-3), ffn=(1e-5, 2e-3), latency=1e-4), message_cpu=2e-4)
    routed = Layout(1, 2, 8, micro_batches=2, routing="attention")
    plain, held = run(routed, c), run(routed, dataclasses.replace(c, rendezvous=True))
    assert held.step_time > plain.step_time  # each rows message waited for the node's previous compute
    rows_messages = len(SHAPE.moe_layers) * 2 * 2  # layers x micro-batches x FFN nodes
    base, extra = run(routed, with_cores(c, 2)), run(routed, with_cores(dataclasses.replace(c, rendezvous=True), 2))
    assert extra.host_cpu == pytest.approx(base.host_cpu + rows_messages * 2e-4)
    broadcast = Layout(1, 2, 8, micro_batches=2)
    assert run(broadcast, dataclasses.replace(c, rendezvous=True)) == run(broadcast, c)
    assert CostModel.from_json(dataclasses.replace(c, rendezvous=True).to_json()).rendezvous
