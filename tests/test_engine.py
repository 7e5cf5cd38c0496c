"""The engine on its own (colocated, stepped by hand): one request's failure is its own, and the
gauges follow aborts."""

from __future__ import annotations

import pytest
import torch
from hf_reference import PROMPTS

import afd
from afd.dataplane.exchange import LocalMoE
from afd.engine import offline
from afd.engine.request import Request
from afd.engine.sampling import SamplingParams
from afd.observability.metrics import AttentionMetrics


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return afd.LLM(tiny_checkpoint)


def _engine(llm, metrics=None):
    eng = offline.job_engine(llm.attn, LocalMoE(llm.ffn, llm.backend), PROMPTS, [8] * len(PROMPTS), torch.float32,
                             llm.backend.device)
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
    assert good == llm.generate([PROMPTS[1]], 8)[0]


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
