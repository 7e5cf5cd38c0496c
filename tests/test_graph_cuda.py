"""Graph mode's CUDA graphs, where a GPU exists (make test-device runs this file): greedy tokens equal the
CPU's eager ones, with padding (3 rows into bucket 4, 5 into 8) and with two micro-batches in flight."""

from __future__ import annotations

import pytest
import torch
from test_graph_mode import PROMPTS5, N, steps_by_mode

import afd
from afd.engine import offline
from afd.engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("n", [3, 5], ids=["3-into-4", "5-into-8"])
def test_cuda_graphs_give_the_cpu_tokens(tiny_checkpoint, n):
    ref = afd.LLM(tiny_checkpoint, block_size=16).generate_ids(PROMPTS5[:n], N, ignore_eos=True)
    llm = afd.LLM(tiny_checkpoint, device="cuda", block_size=16, graph_mode="compile", graph_batch_sizes=(4, 8))
    assert llm.generate_ids(PROMPTS5[:n], N, ignore_eos=True) == ref
    assert llm.graph_report["steps"] == steps_by_mode()
    assert list(llm.graph_report["compile_seconds"]) == [f"{4 if n == 3 else 8}x2"]


def test_cuda_graphs_with_two_micro_batches_in_flight(tiny_checkpoint):
    """Both micro-batches replay the same graphs (bucket 4): each keeps its own outputs (they are cloned)."""
    ref = afd.LLM(tiny_checkpoint, block_size=16).generate_ids(PROMPTS5, N, ignore_eos=True)
    llm = afd.LLM(tiny_checkpoint, device="cuda", block_size=16)
    per = [N] * len(PROMPTS5)
    engine = llm.job_engine(PROMPTS5, per, micro_batches=2, graph_mode="compile", graph_batch_sizes=(4,))
    assert offline.generate(engine, PROMPTS5, per, SamplingParams(), ignore_eos=True) == ref
    assert engine.runner.attn.steps == steps_by_mode(micro_batches=2)
