"""Graph mode (afd.engine.graph): the padded, compiled decode path gives the eager path's and HF's tokens.

These run the graphs through dynamo with fullgraph=True and AOTAutograd (backend aot_eager): the same
trace, functionalization and static shapes as inductor, without its C++ compile (30 s cold per process
here). tests/test_graph_compile.py runs inductor itself (make test-slow); tests/test_graph_npu.py torchair.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hf_reference import PROMPTS, hf_greedy

import afd
from afd.backend.cpu import CpuBackend
from afd.engine import graph, offline
from afd.engine.sampling import SamplingParams
from afd.model import latent_cache

N = 8
# 5 sequences (bucket 8), the first 3 (bucket 4); at most 20 + N tokens: 2 blocks of 16
PROMPTS5 = [PROMPTS[0][:20], *PROMPTS[1:], [2, 9, 4, 4, 8, 1]]


@pytest.fixture
def traced(monkeypatch):
    """CpuBackend.compile with aot_eager in inductor's place, recording every graph dynamo hands over."""
    graphs: list[torch.fx.GraphModule] = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    monkeypatch.setattr(CpuBackend, "graph_compiler", staticmethod(record))
    torch._dynamo.reset()
    yield graphs
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def hf_ref(tiny_checkpoint):
    return [ids for ids, _ in hf_greedy(tiny_checkpoint, PROMPTS5, N)]


def steps_by_mode(decode_steps: int = N - 1, layers: int = 2, micro_batches: int = 1) -> dict:
    """A job's forward passes by mode (GraphHalf.steps): the prefill, and the first 2L - 1 decode steps, which
    compile one of the L layers' 2L graphs each and run the rest eager, count as eager; per micro-batch."""
    partial = min(decode_steps, 2 * layers - 1)
    return {"graph": micro_batches * (decode_steps - partial), "eager": micro_batches * (1 + partial)}


def _engine(llm, prompts, settings, micro_batches=1):
    graph = {} if settings is None else {"graph_mode": settings.mode, "graph_batch_sizes": settings.batch_sizes}
    return llm.job_engine(prompts, [N] * len(prompts), micro_batches=micro_batches, **graph)


def _job(llm, prompts, settings, micro_batches=1):
    engine = _engine(llm, prompts, settings, micro_batches)
    return offline.generate(engine, prompts, [N] * len(prompts), SamplingParams(), ignore_eos=True), engine


@pytest.mark.parametrize("n", [3, 5], ids=["3-into-4", "5-into-8"])
def test_padded_graphs_give_eager_and_hf_tokens(tiny_checkpoint, hf_ref, traced, n):
    # blocks of 16: every sequence's table is 1 or 2 blocks wide here, one graph width (2)
    llm = afd.LLM(tiny_checkpoint, block_size=16, graph_mode="compile", graph_batch_sizes=(4, 8))
    prompts = PROMPTS5[:n]
    assert llm.generate_ids(prompts, N, ignore_eos=True) == hf_ref[:n]
    steps = llm.graph_report["steps"]
    assert steps == steps_by_mode()  # the prefill runs eager, every decode step padded
    assert list(llm.graph_report["compile_seconds"]) == [f"{4 if n == 3 else 8}x2"]
    # one graph per phase and layer (fullgraph), one compiled per step (so the last N - 5 steps ran every layer
    # in graphs), none with a host sync (refuse_host_syncs would have refused it)
    assert len(traced) == 2 * llm.cfg.num_layers < N - 1


def test_padded_rows_write_only_the_scratch_block(tiny_checkpoint, traced):
    llm = afd.LLM(tiny_checkpoint, block_size=16)
    eager_out, eager = _job(llm, PROMPTS5[:3], None)
    eng = _engine(llm, PROMPTS5[:3], graph.GraphSettings("compile", (4,)))
    kv, half = eng.runner.kv, eng.runner.attn
    assert isinstance(half, graph.GraphHalf)
    assert kv.allocator.num_blocks == eager.runner.kv.allocator.num_blocks + 1  # the job's cache got one more...
    assert half.scratch_block == 0  # ...which graph mode took first: the sequences hold blocks 1.. (eager: 0..)
    C = llm.cfg.kv_lora_rank
    planes = [  # each MLA's (c, k_rot) planes [blocks, block_size, C or R] (afd.model.latent_cache)
        (latent_cache.planes(kv.data[i, j], C), latent_cache.planes(eager.runner.kv.data[i, j], C))
        for i in range(kv.data.shape[0])
        for j in range(kv.data.shape[1])
    ]
    for mine, _ in planes:
        for plane in mine:
            plane[0] = 1e4  # a marker: a real row reading the scratch block would change its tokens
    assert offline.generate(eng, PROMPTS5[:3], [N] * 3, SamplingParams(), ignore_eos=True) == eager_out
    for mine, theirs in planes:
        for got, want in zip(mine, theirs):
            # the sequences' blocks: as eager, up to rounding. The graph runs 4 rows where eager runs 3, and MKL
            # picks its sgemm kernel by shape (and by CPU), so fp32 sums of O(1) latents may differ in their last
            # bits after a few layers: 3e-6 was seen on an AVX-512 EPYC.
            torch.testing.assert_close(got[1:], want, rtol=1e-5, atol=1e-5)
            assert (got[0, 1:] == 1e4).all() and (got[0, 0] != 1e4).all()  # padded rows wrote slot 0 only


@pytest.mark.slow  # CI runs it in make test-slow; a default case covers the same path
def test_micro_batches_and_fallbacks(tiny_checkpoint, hf_ref, traced, caplog):
    llm = afd.LLM(tiny_checkpoint, block_size=4)
    out, eng = _job(llm, PROMPTS5, graph.GraphSettings("compile", (4,)), micro_batches=2)  # 2 + 3 rows, bucket 4
    half = eng.runner.attn
    assert out == hf_ref and sum(half.steps.values()) == 2 * N and half.steps["graph"] >= 1
    assert len(half._fns) <= N - 1  # one compile per step, whatever its micro-batches (block tables of 2-8)
    out, eng = _job(llm, PROMPTS5, graph.GraphSettings("compile", (4,)))  # 5 rows: no bucket, eager
    assert out == hf_ref and eng.runner.attn.steps == {"graph": 0, "eager": N}

    class TP:  # what wrap reads of a TP group
        size, cfg = 2, type("C", (), {"kvp": 2})

    with caplog.at_level(logging.INFO, logger="afd.graph"):
        assert graph.wrap(llm.attn, eng.runner.kv, graph.GraphSettings("compile"), TP()) is llm.attn
    assert "attention TP (2 ranks, kvp 2) runs eager" in caplog.text
    assert graph.wrap(llm.attn, eng.runner.kv, graph.GraphSettings("eager"), TP()) is llm.attn


def test_a_graph_that_does_not_trace_runs_eager(tiny_checkpoint, hf_ref, traced, monkeypatch, caplog):
    """A host sync in a layer breaks its graph (fullgraph): that graph runs eager, said once, tokens unchanged."""
    llm = afd.LLM(tiny_checkpoint, block_size=4, graph_mode="compile", graph_batch_sizes=(4,))
    pre = type(llm.attn).pre_moe

    def syncing(self, i, x, *rest):
        if i == 1:
            x = x + x.sum().item() * 0
        return pre(self, i, x, *rest)

    monkeypatch.setattr(type(llm.attn), "pre_moe", syncing)
    with caplog.at_level(logging.WARNING, logger="afd.graph"):
        assert llm.generate_ids(PROMPTS5[:3], N, ignore_eos=True) == hf_ref[:3]
    assert caplog.text.count("does not compile") == len({k for k in llm.graph_report["compile_seconds"]})


def test_the_half_passes_every_attribute_through(tiny_checkpoint, traced):
    llm = afd.LLM(tiny_checkpoint, block_size=4)
    half = _engine(llm, [[5, 6]], graph.GraphSettings("compile", (1,))).runner.attn
    assert isinstance(half, graph.GraphHalf)
    assert half.cfg is llm.attn.cfg and half.lm_head is llm.attn.lm_head and half.norm is llm.attn.norm
    assert half.supports_tp is True and half.embed_tokens is llm.attn.embed_tokens
    with pytest.raises(AttributeError):
        half.no_such_attribute  # noqa: B018


@pytest.mark.parametrize(
    "family", [pytest.param("deepseek_v3", marks=pytest.mark.slow), pytest.param("qwen3_moe", marks=pytest.mark.slow)]
)
def test_other_families(tmp_path, traced, family):
    """DeepSeek-V3 with a dense first layer (pre_moe's m is None there) and Qwen3-MoE (GQA's K and V cache)."""
    from afd.bench.common import write_config
    from afd.bench.step import DEEPSEEK_V3, QWEN3_MOE

    small = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32)
    cfg = (
        {**DEEPSEEK_V3, **small, "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 16}
        if family == "deepseek_v3"
        else {**QWEN3_MOE, **small, "mlp_only_layers": [0]}
    )
    path = write_config(str(tmp_path / family), cfg)
    prompts = [[3, 4, 5], [9, 8], [7, 7, 7, 7]]
    ref = afd.LLM(path, dummy_weights=True, block_size=4).generate_ids(prompts, N, ignore_eos=True)
    llm = afd.LLM(path, dummy_weights=True, block_size=4, graph_mode="compile", graph_batch_sizes=(4,))
    assert llm.generate_ids(prompts, N, ignore_eos=True) == ref
    steps = llm.graph_report["steps"]  # block tables of 1-3 blocks: three widths, each compiled a step at a time
    assert sum(steps.values()) == N and steps["graph"] >= 1


@pytest.mark.parametrize("sync", ["item", "tolist", "aten_op"])
def test_host_syncs_are_refused_in_every_spelling(sync):
    """.item() / .tolist() as dynamo hands them over, and aten._local_scalar_dense as an OpOverload target."""
    from afd.backend.base import refuse_host_syncs

    def fn(x):
        if sync == "aten_op":
            return x * torch.ops.aten._local_scalar_dense.default(x.sum())
        return x * (x.sum().item() if sync == "item" else x.long().sum().tolist())

    gm = torch.fx.symbolic_trace(fn) if sync == "aten_op" else None
    backend = refuse_host_syncs("eager")
    if gm is not None:
        with pytest.raises(RuntimeError, match="_local_scalar_dense"):
            backend(gm, [torch.ones(2)])
        return
    torch._dynamo.reset()
    with pytest.raises(Exception, match="host sync"):
        torch.compile(fn, backend=backend, fullgraph=True)(torch.ones(2))
    torch._dynamo.reset()
