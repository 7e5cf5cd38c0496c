"""Graph mode with inductor itself (CPU): HF's tokens colocated and at 1A1F, the compile cache a restart
reuses, and the KV write compiled in place. make test-slow: a cold inductor compile takes 30 s here."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from hf_reference import hf_greedy
from test_graph_mode import PROMPTS5, N, steps_by_mode

import afd

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One inductor cache for the module: the first test compiles, the others mostly reload."""
    return str(tmp_path_factory.mktemp("inductor"))


@pytest.fixture(scope="module")
def hf_ref(tiny_checkpoint):
    return [ids for ids, _ in hf_greedy(tiny_checkpoint, PROMPTS5, N)]


@pytest.mark.parametrize("n", [3, 5], ids=["3-into-4", "5-into-8"])
def test_inductor_colocated_gives_eager_and_hf_tokens(tiny_checkpoint, hf_ref, cache_dir, n):
    eager = afd.LLM(tiny_checkpoint, block_size=16).generate_ids(PROMPTS5[:n], N, ignore_eos=True)
    llm = afd.LLM(
        tiny_checkpoint, block_size=16, graph_mode="compile", graph_batch_sizes=(4, 8), compile_cache_dir=cache_dir
    )
    assert llm.generate_ids(PROMPTS5[:n], N, ignore_eos=True) == eager == hf_ref[:n]
    assert llm.graph_report["steps"] == steps_by_mode()
    assert list(llm.graph_report["compile_seconds"]) == [f"{4 if n == 3 else 8}x2"]


def test_inductor_at_1a1f_gives_hf_tokens(tiny_checkpoint, hf_ref, cache_dir):
    llm = afd.LLM(
        tiny_checkpoint,
        block_size=16,
        attention_nodes=1,
        ffn_nodes=1,
        graph_mode="compile",
        graph_batch_sizes=(4,),
        compile_cache_dir=cache_dir,
    )
    assert llm.generate_ids(PROMPTS5[:3], N, ignore_eos=True) == hf_ref[:3]
    assert llm.graph_report["steps"] == steps_by_mode()


def test_inductor_at_2a2f_and_under_tp_gives_hf_tokens(tiny_checkpoint, hf_ref, cache_dir):
    """Every topology: two attention nodes (each its own graphs, out of one cache) over two FFN nodes, and an
    attention node of TP 2, whose half runs eager in graph mode (its collectives stay outside graphs)."""
    llm = afd.LLM(
        tiny_checkpoint,
        block_size=16,
        attention_nodes=2,
        ffn_nodes=2,
        graph_mode="compile",
        graph_batch_sizes=(4,),
        compile_cache_dir=cache_dir,
    )
    assert llm.generate_ids(PROMPTS5, N, ignore_eos=True) == hf_ref
    assert llm.graph_report["steps"] == steps_by_mode()
    tp = afd.LLM(
        tiny_checkpoint,
        block_size=16,
        attention_nodes=1,
        ffn_nodes=1,
        attention_tp=2,
        graph_mode="compile",
        graph_batch_sizes=(4,),
        compile_cache_dir=cache_dir,
    )
    assert tp.generate_ids(PROMPTS5[:3], N, ignore_eos=True) == hf_ref[:3]
    assert tp.graph_report is None  # eager: no graph counters


RESTART = textwrap.dedent("""
    import json, sys, time, torch
    torch.set_num_threads(1)
    import afd
    from torch._dynamo.utils import counters
    llm = afd.LLM(sys.argv[1], block_size=16, graph_mode="compile", graph_batch_sizes=(4,),
                  compile_cache_dir=sys.argv[2])
    out = llm.generate_ids([[5, 6, 7], [8, 9], [10]], 7, ignore_eos=True)
    print(json.dumps({"out": out, "seconds": sum(llm.graph_report["compile_seconds"].values()),
                      "inductor": dict(counters["inductor"])}))
""")


def test_a_restart_reuses_the_compile_cache(tiny_checkpoint, tmp_path):
    def start() -> dict:
        run = subprocess.run(
            [sys.executable, "-c", RESTART, tiny_checkpoint, str(tmp_path / "cache")],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        return json.loads(run.stdout.strip().splitlines()[-1])

    cold, warm = start(), start()
    assert warm["out"] == cold["out"]
    assert cold["inductor"].get("fxgraph_cache_miss", 0) >= 1 and not cold["inductor"].get("fxgraph_cache_hit")
    assert warm["inductor"].get("fxgraph_cache_hit", 0) >= 1 and not warm["inductor"].get("fxgraph_cache_miss")
    assert warm["seconds"] < cold["seconds"] / 2, (cold["seconds"], warm["seconds"])


def test_the_kv_write_compiles_in_place():
    """store_kv into a view of a graph input: inductor writes the slots, it does not copy the cache layer."""
    from torch._inductor.utils import run_and_get_code

    from afd.model.attention_metadata import store_kv

    def step(kv, slots, values):
        store_kv(kv[0], slots, values)
        return values * 2

    kv = torch.zeros(2, 512, 16, 72)  # a layer: [2 (MLA's two attentions), blocks, block size, C + R]
    with torch.inference_mode():
        _, code = run_and_get_code(
            torch.compile(step, dynamic=False, fullgraph=True), kv, torch.tensor([1, 9]), torch.ones(2, 72)
        )
    assert torch.equal(kv[0].flatten(0, 1)[[1, 9]], torch.ones(2, 72))
    assert not re.search(rf"<static_cast<int64_t>\({kv.numel() // 2}L\)", "\n".join(code))  # no loop over it


def test_the_latent_planes_write_compiles_in_place():
    """MLA's write into its layer's two planes (afd.model.latent_cache, views of a view of a graph input):
    inductor writes the slots, it copies neither plane nor the layer."""
    from torch._inductor.utils import run_and_get_code

    from afd.model import latent_cache

    def step(kv, slots, c, k_rot):
        latent_cache.store(kv[0], slots, c, k_rot)
        return c * 2

    kv = torch.zeros(2, 512, 16, 72)  # C 64 + R 8
    c, k_rot = torch.ones(2, 64), torch.full((2, 8), 3.0)
    with torch.inference_mode():
        _, code = run_and_get_code(
            torch.compile(step, dynamic=False, fullgraph=True), kv, torch.tensor([1, 9]), c, k_rot
        )
    planes = latent_cache.planes(kv[0], 64)
    assert torch.equal(planes[0].flatten(0, 1)[[1, 9]], c) and torch.equal(planes[1].flatten(0, 1)[[1, 9]], k_rot)
    for n in (kv.numel() // 2, 512 * 16 * 64, 512 * 16 * 8):  # the layer, the c plane, the k_rot plane
        assert not re.search(rf"<static_cast<int64_t>\({n}L\)", "\n".join(code)), n
