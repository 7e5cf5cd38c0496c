"""The engine on its own (colocated, stepped by hand): one request's failure is its own, the gauges
follow aborts, and a data-plane failure mid-step is rejoined with nothing lost."""

from __future__ import annotations

import logging
import time

import pytest
from hf_reference import PROMPTS

import afd
from afd.control.client import ControlError
from afd.dataplane.exchange import LocalMoE
from afd.dataplane.transport import PeerError
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
    """The colocated exchange, recording what the engine tells its FFN peers; `fail` raises in submit,
    once `fail_after` submits of the current step went through (mid-step: earlier layers ran)."""

    def __init__(self, llm, fail: Exception | None = None, fail_after: int = 0):
        super().__init__(llm.ffn, llm.backend)
        self.fail, self.fail_after, self.left = fail, fail_after, []
        self.in_step = self.submits = 0
        self.failed_at: list[int] = []

    def begin_step(self, tokens_per_micro_batch, mtp=False):
        self.in_step = 0

    def submit(self, layer, micro_batch, m):
        if self.fail is not None and self.in_step >= self.fail_after:
            self.failed_at.append(self.in_step)
            fail, self.fail = self.fail, None  # the exchange is dropped after its failure: it fails once
            raise fail
        self.in_step += 1
        self.submits += 1
        return super().submit(layer, micro_batch, m)

    def leave(self, shutdown: bool = False) -> None:
        self.left.append("shutdown" if shutdown else "leave")


def _serve(engine, prompts, outs: dict) -> None:
    engine.start()
    for i, p in enumerate(prompts):
        engine.add_request(_request(str(i), p, SamplingParams(), outs))
    deadline = time.monotonic() + 30
    while engine.num_unfinished() and not engine.dead:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _tokens(outs: dict, rid: str) -> list[int]:
    return [t for o in outs[rid] for t in o.new_token_ids]


def test_an_engine_that_dies_of_a_bug_releases_its_data_plane(llm):
    """Its FFN peers must see it go at once (and serve the others), not wait out comm_timeout."""
    engine, outs, released = _engine(llm), {}, []
    engine.runner.moe = _Recording(llm, fail=KeyError("a bug"))
    engine.membership = PlaneMembership(lambda why: pytest.fail(why), lambda: released.append(1))
    _serve(engine, PROMPTS[:2], outs)
    engine.stop()
    assert engine.dead and "engine failed" in engine.dead and released == [1]
    assert all(o[-1].finished and "engine failed" in o[-1].error for o in outs.values())


def test_a_peer_failing_mid_step_is_rejoined_and_the_step_reruns_with_nothing_lost(llm, caplog):
    """A PeerError inside a step (an FFN peer died): the engine drops the exchange, forms its pairs again
    through membership.rejoin and runs the step again; every request streams on, token for token what
    it would have been, none twice or missing."""
    engine, outs, rejoined = _engine(llm), {}, []
    old, new = _Recording(llm), _Recording(llm)
    engine.runner.moe = old

    def rejoin(why):
        rejoined.append((why, engine.runner.moe, engine.paused))
        return new

    engine.membership = PlaneMembership(rejoin, lambda: pytest.fail("released"))
    caplog.set_level(logging.INFO, "afd")
    engine.start()
    for i, p in enumerate(PROMPTS[:2]):
        engine.add_request(_request(str(i), p, SamplingParams(), outs))
    deadline = time.monotonic() + 30
    while not (outs.get("0") and outs.get("1")):  # both stream: the failure comes mid-stream
        assert time.monotonic() < deadline and not engine.dead, engine.dead
        time.sleep(0.001)
    old.fail_after = 1
    old.fail = PeerError("ffn0 (rank 2): recv timed out")
    while engine.num_unfinished():
        assert time.monotonic() < deadline and not engine.dead, engine.dead
        time.sleep(0.01)
    engine.stop()
    assert old.failed_at == [1] and new.submits > 0  # failed after one layer of its step had run
    why = "ffn0 (rank 2): recv timed out"
    assert rejoined == [(why, None, why)]  # the failed exchange was dropped first; requests were paused
    assert engine.paused is None and engine.dead is None
    assert new.left == ["leave"] and old.left == []  # the failed pairs are never stepped on again
    for i, p in enumerate(PROMPTS[:2]):
        assert _tokens(outs, str(i)) == llm.generate_ids([p], 8)[0]
        assert outs[str(i)][-1].finished and not outs[str(i)][-1].error
    said = [r.getMessage() for r in caplog.records]
    assert f"requests paused: {why}" in said and "data plane re-formed; 2 request(s) resume" in said


def test_a_rejoin_that_fails_fails_the_requests_with_both_reasons(llm):
    """No FFN node came back within rejoin_timeout: the requests fail with one line saying why, and the
    engine releases its end of the data plane."""
    engine, outs, released = _engine(llm), {}, []
    engine.runner.moe = _Recording(llm, fail=PeerError("ffn0 (rank 2): recv timed out"), fail_after=1)

    def rejoin(why):
        raise ControlError("no pair formed with FFN node ffn0 within 1s (last: connection refused)")

    engine.membership = PlaneMembership(rejoin, lambda: released.append(1))
    stopped: list[str] = []
    engine.on_dead = stopped.append  # the serving node exits for a restart then (attention_node/serving_node.py)
    _serve(engine, PROMPTS[:2], outs)
    engine.stop()
    reason = "ffn0 (rank 2): recv timed out; no pair formed with FFN node ffn0 within 1s (last: connection refused)"
    assert engine.dead == reason and released == [1] and stopped == [reason]
    assert all(o[-1].finished and o[-1].error == reason for o in outs.values())


def test_a_request_whose_sampling_raises_fails_alone():
    """sample_step draws every row in one batch; when that raises it draws entry by entry, and an entry that
    still raises comes back with no tokens and its error in `errors` (the engine fails that request alone),
    while the other entry gets its token."""
    import torch

    from afd.engine.messages import ScheduledSeq, StepPlan
    from afd.engine.sampling import Sampler, sample_step

    class Picky(Sampler):
        def draw(self, logits, rows, drafts=None):
            if any(r.request_id == "bad" for r in rows):
                raise RuntimeError("no token for bad")
            return super().draw(logits, rows, drafts)

    reqs = [Request(r, [1, 5], SamplingParams(temperature=0), 8, lambda out: None) for r in ("bad", "good")]
    plan = StepPlan(tuple(ScheduledSeq(r, 2, 1, 0, True, None) for r in reqs))
    logits = torch.zeros(2, 16)
    logits[1, 9] = 5.0
    out = sample_step(Picky(), plan, logits)
    assert out.tokens == [None, [9]]
    assert list(out.errors) == [0] and "no token for bad" in str(out.errors[0])
