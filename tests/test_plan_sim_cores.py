"""afd.plan.simulate with the host's cores shared (CostModel.host_cores): a CPU profile's plans run every node
process on one host, so more processes than cores slow each other. Pure Python, fast."""

from __future__ import annotations

import dataclasses

import pytest

from afd.plan.costs import CostModel
from afd.plan.shape import Layout
from afd.plan.simulate import Timeline
from tests.test_plan_simulate import costs, run


def with_cores(c: CostModel, n: int) -> CostModel:
    return dataclasses.replace(c, host_cores=n)


def test_enough_cores_change_nothing():
    c = costs(window=(2e-6, 3e-4), overhead=(1e-6, 2e-3))
    for lay in (Layout(1, 1, 8, overlap=False), Layout(2, 1, 8, micro_batches=2), Layout(1, 2, 8)):
        assert run(lay, with_cores(c, 3)) == run(lay, c)  # 3 processes, 3 cores


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


def test_a_late_task_takes_an_early_gap():
    tl = Timeline(cores=1)
    assert tl.run("a", 0.0, 1.0, core=True) == 1.0
    assert tl.run("b", 2.0, 1.0, core=True) == 3.0  # the core is free in [1, 2)
    assert tl.run("c", 0.5, 0.5, core=True) == 1.5  # fits the gap [1, 2)
    assert tl.run("d", 0.0, 1.0, core=True) == 4.0  # [1.5, 2) is too short: after b
    assert tl.queued["d"] == 3.0 and tl.idle["d"] == 0.0


def test_host_cores_round_trip_json_and_default():
    c = with_cores(costs(), 2)
    assert CostModel.from_json(c.to_json()).host_cores == 2
    assert CostModel.from_json(costs().to_json()).host_cores == 0
