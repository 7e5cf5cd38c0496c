"""The engine on its own (colocated, stepped by hand): one request's failure is its own, and the
gauges follow aborts."""

from __future__ import annotations

import time

import pytest
from hf_reference import PROMPTS

import afd
from afd.dataplane.exchange import LocalMoE
from afd.engine.membership import PlaneMembership
from afd.engine.request import Request
from afd.engine.sampling import SamplingParams
from afd.observability.attention_metrics import AttentionMetrics


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return afd.LLM(tiny_checkpoint)


def _engine(llm, metrics=None):
    eng = llm.job_engine(PROMPTS, [8] * len(PROMPTS))
    eng.metrics = metrics
    return eng


def _request(rid: str, prompt: list[int], params: SamplingParams, outs: dict) -> Request:
    return Request(rid, prompt, params, 8, lambda o: outs.setdefault(rid, []).append(o))


def test_a_request_failing_in_sampling_fails_alone(llm):
    engine, outs = _engine(llm), {}
    bad = SamplingParams(temperature=1.0)
    bad.seed = 2**64  # past validation: what once reached the engine and killed it for good
    engine.add_request(_request("bad", PROMPTS[0], bad, outs))
    engine.add_request(_request("good", PROMPTS[1], SamplingParams(), outs))
    while engine.has_unfinished():
        assert engine.step() is not None
    assert engine.dead is None
    last = outs["bad"][-1]
    assert last.finished and last.error_code == 500 and "Overflow" in last.error
    good = [t for o in outs["good"] for t in o.new_token_ids]
    assert good == llm.generate_ids([PROMPTS[1]], 8)[0]


def test_gauges_return_to_zero_after_aborts(llm):
    metrics = AttentionMetrics("attn0", "m")
    engine, outs = _engine(llm, metrics), {}
    for i, p in enumerate(PROMPTS[:2]):
        engine.add_request(_request(str(i), p, SamplingParams(), outs))
    engine.step()
    assert metrics.running._value.get() == 2 and metrics.kv_usage._value.get() > 0
    for i in range(2):
        engine.abort(str(i))
    assert engine.step() is None  # nothing left to run: the aborts alone must move the gauges
    assert (metrics.running._value.get(), metrics.kv_usage._value.get()) == (0, 0)
    assert all(o[-1].finish_reason == "abort" for o in outs.values())


class _Recording(LocalMoE):
    """The colocated exchange, recording what the engine tells its FFN peers; `fail` raises in submit."""

    def __init__(self, llm, fail: Exception | None = None):
        super().__init__(llm.ffn, llm.backend)
        self.fail, self.left = fail, []

    def submit(self, layer, micro_batch, m):
        if self.fail is not None:
            raise self.fail
        return super().submit(layer, micro_batch, m)

    def leave(self, shutdown: bool = False, reform: bool = False) -> None:
        self.left.append("reform" if reform else "leave")


def _serve(engine, prompts, outs: dict) -> None:
    engine.start()
    for i, p in enumerate(prompts):
        engine.add_request(_request(str(i), p, SamplingParams(), outs))
    deadline = time.monotonic() + 30
    while engine.num_unfinished() and not engine.dead:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_an_engine_that_dies_of_a_bug_releases_its_data_plane(llm):
    """Its FFN peers must see it go at once (and serve the others), not wait out comm_timeout."""
    engine, outs, released = _engine(llm), {}, []
    engine.runner.moe = _Recording(llm, fail=KeyError("a bug"))
    engine.membership = PlaneMembership(lambda why: pytest.fail(why), lambda: False, lambda: released.append(1))
    _serve(engine, PROMPTS[:2], outs)
    engine.stop()
    assert engine.dead and "engine failed" in engine.dead and released == [1]
    assert all(o[-1].finished and "engine failed" in o[-1].error for o in outs.values())


def test_a_superseded_generation_is_left_at_a_step_boundary_and_nothing_is_lost(llm):
    engine, outs = _engine(llm), {}
    old, new = _Recording(llm), _Recording(llm)
    engine.runner.moe = old
    state = {"superseded": False, "rejoined": []}

    def rejoin(why):
        state["rejoined"].append(why)
        state["superseded"] = False
        return new

    engine.membership = PlaneMembership(rejoin, lambda: state["superseded"], lambda: None)
    engine.start()
    engine.add_request(_request("0", PROMPTS[0], SamplingParams(), outs))
    while not outs.get("0"):
        time.sleep(0.001)
    state["superseded"] = True  # a node was replaced: the coordinator announced the next generation
    deadline = time.monotonic() + 30
    while engine.num_unfinished():
        assert time.monotonic() < deadline and not engine.dead
        time.sleep(0.01)
    engine.stop()
    assert old.left == ["reform"] and len(state["rejoined"]) == 1 and new.left == ["leave"]
    assert [t for o in outs["0"] for t in o.new_token_ids] == llm.generate_ids([PROMPTS[0]], 8)[0]
