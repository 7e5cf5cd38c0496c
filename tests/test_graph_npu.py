"""Graph mode on the Ascend path, without hardware: NpuBackend.compile through the fake torchair's
cache_compile (tests/fakes/torchair, with torchair's documented rules) over a tiny LongCat-Flash on CPU.

What holds here: one cached graph per function (torchair keeps one and runs it unguarded once loaded),
dynamic=False per bucket, npu_prefetch inside the graph with its dependency, the cache found by a restart.
What does not: GE's own lowering (the fake runs the captured graph eagerly) and the fake device's stream
model (these tensors are CPU tensors, so the KV write takes the inductor path of afd.model.attention_metadata
.store_kv, not torchair's).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from test_npu_fakes import _fresh, _npu_backend, ops, torchair  # noqa: F401  (_fresh, torchair: fixtures)

import afd
import afd.backend
from afd.engine import offline
from afd.engine.sampling import SamplingParams

N = 7
PROMPTS = [[5, 6, 7, 8], [1, 40, 41], [60]]  # 3 rows: bucket 4; 4 + N tokens: one block of 16


def _generate(llm, monkeypatch, cache_dir=None):
    # graph mode compiled by the NPU backend (on the fake torchair), over CPU tensors
    monkeypatch.setattr(afd.backend, "get_backend", lambda *a: _npu_backend())
    graph = {"graph_mode": "compile", "graph_batch_sizes": (4,), "compile_cache_dir": cache_dir} if cache_dir else {}
    engine = llm.job_engine(PROMPTS, [N] * 3, **graph)
    return offline.generate(engine, PROMPTS, [N] * 3, SamplingParams(), ignore_eos=True), engine.runner.attn


def test_torchair_graphs_cached_one_per_function_and_reloaded(
    tiny_checkpoint,
    torchair,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    llm = afd.LLM(tiny_checkpoint, block_size=16)
    ref, _ = _generate(llm, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Skip cache as ... recompiled"
        out, half = _generate(llm, monkeypatch, str(tmp_path))
    # compiled at warm-up (NpuBackend.capture_at_warmup), under the steps' inference mode: the warnings
    # filter above fails on a recompile, and every decode step runs in graphs from the first
    assert out == ref and half.steps == {"graph": N - 1, "eager": 1} and half.warmup_graphs == 4
    graphs = half._fns
    assert sorted(graphs) == [(p, i, 4, 1) for p in ("post", "pre") for i in (0, 1)]
    assert all(g.graphs == 1 and not g.loaded for g in graphs.values())
    files = sorted(p.parts[-2].rsplit("_", 1)[0] for p in tmp_path.glob("GraphHalf_static_*/*/compiled_module"))
    assert files == sorted(f"{p}_moe_l{i}_b4_w1" for p in ("pre", "post") for i in (0, 1))  # _ + dtype/cache tag
    # npu_prefetch inside the graphs, each with a dependency (the fake converter refuses None): pre_moe's of
    # dense MLP 0's gate and up, layer 0's post_moe of layer 1's q_a / kv_a projections, 8 MiB at most each
    sizes = {w.numel() * w.element_size() for w in half.prefetch_weights(0, "pre") + half.prefetch_weights(0, "post")}
    assert ops.calls and {c[1] for c in ops.calls} <= sizes and all(c[0] == "npu_prefetch" for c in ops.calls)

    torch._dynamo.reset()  # a restart: the same cache directory
    out, half = _generate(llm, monkeypatch, str(tmp_path))
    assert out == ref and all(g.loaded for g in half._fns.values())


def test_fake_cache_compile_keeps_one_graph_per_function(torchair, tmp_path):  # noqa: F811
    class M(torch.nn.Module):
        def step(self, x):
            return x * 2

    cached = torchair.inference.cache_compile(M().step, dynamic=False, cache_dir=str(tmp_path))
    cached(torch.ones(2))
    assert list(tmp_path.glob("M_static_*/step/compiled_module"))
    with pytest.warns(UserWarning, match="Skip cache as .* recompiled"):
        cached(torch.ones(3))  # another shape: a second graph, which torchair does not cache
    assert not list(tmp_path.glob("M_static_*/step/compiled_module"))
    first = torchair.inference.cache_compile(M().step, dynamic=False, cache_dir=str(tmp_path))
    first(torch.ones(2))
    torch._dynamo.reset()
    loaded = torchair.inference.cache_compile(M().step, dynamic=False, cache_dir=str(tmp_path))
    assert torch.equal(loaded(torch.ones(2)), torch.full((2,), 2.0)) and loaded.loaded
    with pytest.raises(RuntimeError, match="compiled for other inputs"):
        loaded(torch.ones(3))  # torchair would run the cached graph unguarded
