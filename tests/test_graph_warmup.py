"""Graph mode's warm-up (afd.engine.graph_warmup): where the backend captures at warm-up (CUDA, NPU), every
graph is compiled before the first step and none inside one, and the tokens are eager's and HF's.

The backend here is the CPU's with capture_at_warmup on and the base class's compile (the function itself:
what is tested is when a graph's first call, where CUDA captures, happens, not what compiles it; the fake
torchair's test, tests/test_graph_npu.py, runs warm-up through dynamo). It records, for each graph, whether
its first call ran inside a step.
"""

from __future__ import annotations

import logging

import pytest
from test_graph_mode import PROMPTS5, N

import afd
import afd.backend
from afd.backend.base import Backend
from afd.backend.cpu import CpuBackend
from afd.engine import graph_warmup, offline
from afd.engine.graph import graph_report
from afd.engine.runner import ModelRunner
from afd.engine.sampling import SamplingParams


class CapturingCpu(CpuBackend):
    """CPU compile, capture_at_warmup as on CUDA; each graph's first call recorded with whether a step ran."""

    capture_at_warmup = True

    def __init__(self):
        self.in_step = False
        self.captures: list[tuple[str, bool]] = []  # (graph name, inside a step)

    def compile(self, fn, cache_dir=None):
        compiled, name = Backend.compile(self, fn, cache_dir), fn.__name__
        first = [True]

        def call(*args):
            if first[0]:
                first[0] = False
                self.captures.append((name, self.in_step))
            return compiled(*args)

        return call


@pytest.fixture
def capturing(monkeypatch):
    backend = CapturingCpu()
    monkeypatch.setattr(afd.backend, "get_backend", lambda *a: backend)
    execute = ModelRunner.execute

    def step(self, *args, **kwargs):
        backend.in_step = True
        try:
            return execute(self, *args, **kwargs)
        finally:
            backend.in_step = False

    monkeypatch.setattr(ModelRunner, "execute", step)
    return backend


def test_every_graph_is_captured_before_the_first_step(tiny_checkpoint, capturing, caplog):
    llm = afd.LLM(tiny_checkpoint, block_size=32)
    per, eager = [N] * 3, llm.generate_ids(PROMPTS5[:3], N, ignore_eos=True)  # HF's (tests/test_graph_mode.py)
    with caplog.at_level(logging.INFO, logger="afd.graph"):
        engine = llm.job_engine(PROMPTS5[:3], per, graph_mode="compile", graph_batch_sizes=(4, 8))
    # 3 rows: bucket 4 only (8 never forms); 20 + N tokens at most: one block, width 1; 2 phases per layer
    graphs = 2 * llm.cfg.num_layers
    assert len(capturing.captures) == graphs and not any(inside for _, inside in capturing.captures)
    assert f"warm-up compiled {graphs} graphs" in caplog.text
    out = offline.generate(engine, PROMPTS5[:3], per, SamplingParams(), ignore_eos=True)
    assert out == eager
    assert len(capturing.captures) == graphs  # none inside a step
    half = engine.runner.attn
    assert half.steps == {"graph": N - 1, "eager": 1}  # every decode step in graphs from the first
    report = graph_report(half)
    assert report is not None and report["warmup_graphs"] == graphs and report["warmup_seconds"] > 0


def test_a_shape_left_out_of_warm_up_runs_eager(tiny_checkpoint, capturing, monkeypatch, caplog):
    """A step that meets a (bucket, width) warm-up did not compile runs it eager, said once: never a capture."""
    monkeypatch.setattr(graph_warmup, "shapes", lambda *a: [])  # nothing warmed up
    llm = afd.LLM(tiny_checkpoint, block_size=16)
    per, eager = [N] * 3, llm.generate_ids(PROMPTS5[:3], N, ignore_eos=True)
    engine = llm.job_engine(PROMPTS5[:3], per, graph_mode="compile", graph_batch_sizes=(4,))
    with caplog.at_level(logging.WARNING, logger="afd.graph"):
        out = offline.generate(engine, PROMPTS5[:3], per, SamplingParams(), ignore_eos=True)
    assert out == eager and capturing.captures == []
    assert engine.runner.attn.steps == {"graph": 0, "eager": N}
    assert caplog.text.count("was not compiled at warm-up") == 1


def test_shapes_cover_what_a_step_can_pad_to():
    assert graph_warmup.shapes([1, 2, 4, 8], 3, 5) == [(b, w) for b in (1, 2, 4) for w in (1, 2, 4, 8)]
    assert graph_warmup.shapes([1, 2, 4], 100, 1) == [(1, 1), (2, 1), (4, 1)]  # above every bucket: all of them
    assert graph_warmup.shapes([4], 1, 4) == [(4, 1), (4, 2), (4, 4)]


def test_warm_up_keeps_the_ffn_nodes_waiting_within_their_timeout(tiny_checkpoint, capturing, monkeypatch):
    """The FFN nodes wait for this node's next step header at most comm_timeout: warm-up sends idle steps."""
    from afd.dataplane.exchange import LocalMoE

    idles: list[int] = []
    monkeypatch.setattr(graph_warmup, "KEEP_ALIVE_SECONDS", -1.0)  # one after every layer
    monkeypatch.setattr(LocalMoE, "idle", lambda self: idles.append(len(capturing.captures)) or 0)
    llm = afd.LLM(tiny_checkpoint, block_size=16)
    llm.job_engine(PROMPTS5[:3], [N] * 3, graph_mode="compile", graph_batch_sizes=(4,))
    layers = llm.cfg.num_layers
    assert idles == [2 * (i + 1) for i in range(2 * layers)]  # widths 1 and 2, after each layer's two graphs
