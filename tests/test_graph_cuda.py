"""Graph mode's CUDA graphs, where a GPU exists (make test-device runs this file): greedy tokens equal the
CPU's eager ones, with padding (3 rows into bucket 4, 5 into 8) and with two micro-batches in flight, every
graph captured at warm-up."""

from __future__ import annotations

import pytest
import torch
from test_graph_mode import PROMPTS5, N

import afd
from afd.engine import offline
from afd.engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("n", [3, 5], ids=["3-into-4", "5-into-8"])
def test_cuda_graphs_give_the_cpu_tokens(tiny_checkpoint, n):
    ref = afd.LLM(tiny_checkpoint, block_size=16).generate_ids(PROMPTS5[:n], N, ignore_eos=True)
    llm = afd.LLM(tiny_checkpoint, device="cuda", block_size=16, graph_mode="compile", graph_batch_sizes=(4, 8))
    assert llm.generate_ids(PROMPTS5[:n], N, ignore_eos=True) == ref
    # captured at warm-up (CudaBackend.capture_at_warmup): every decode step replays graphs from the first;
    # the buckets up to the job's (4 for 3 rows, 8 for 5), each at widths 1 and 2 (28 tokens: 2 blocks of 16)
    assert llm.graph_report["steps"] == {"graph": N - 1, "eager": 1}
    buckets = (4,) if n == 3 else (4, 8)
    assert sorted(llm.graph_report["compile_seconds"]) == [f"{b}x{w}" for b in buckets for w in (1, 2)]
    assert llm.graph_report["warmup_graphs"] == 2 * 2 * len(buckets) * llm.cfg.num_layers


def test_cuda_graphs_with_two_micro_batches_in_flight(tiny_checkpoint):
    """Both micro-batches replay the same graphs (bucket 4): each keeps its own outputs (they are cloned)."""
    ref = afd.LLM(tiny_checkpoint, block_size=16).generate_ids(PROMPTS5, N, ignore_eos=True)
    llm = afd.LLM(tiny_checkpoint, device="cuda", block_size=16)
    per = [N] * len(PROMPTS5)
    engine = llm.job_engine(PROMPTS5, per, micro_batches=2, graph_mode="compile", graph_batch_sizes=(4,))
    assert offline.generate(engine, PROMPTS5, per, SamplingParams(), ignore_eos=True) == ref
    assert engine.runner.attn.steps == {"graph": 2 * (N - 1), "eager": 2}  # captured at warm-up
