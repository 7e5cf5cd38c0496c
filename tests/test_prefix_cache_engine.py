"""Prefix caching in the engine: greedy tokens unchanged with the cache on for every family's cache kind
(MLA latents, GQA K/V), under memory pressure, with MTP (its layer's cache and drafts too), and served
with attention TP and KVP, while fewer tokens are computed and the hits are counted."""

from __future__ import annotations

import pytest
import torch

import afd
from afd.engine.request import Request
from afd.engine.sampling import SamplingParams
from afd.engine.scheduler import Scheduler
from afd.model import latent_cache
from afd.observability.attention_metrics import AttentionMetrics

SHARED = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49]  # 3 blocks of 4
GROUPS = [[SHARED + [50, 51, 52]], [SHARED + [53, 54], SHARED + [55], SHARED + [50, 51, 52]]]
"""The first request runs alone; then three that share its prefix (the last: its whole prompt)."""
NEW = 6


def mtp_kv(engine, rid: str = "1") -> torch.Tensor | None:
    """The MTP layer's cache at the computed positions of running request `rid` [positions, C + R]."""
    req = next((r for r in engine.scheduler.running if r.request_id == rid), None)
    if req is None:
        return None
    kv = engine.runner.mtp_kv  # [blocks, block_size, C + R] as MLA's two planes (afd.model.latent_cache)
    c, k_rot = latent_cache.read(kv, engine.runner.attn.cfg.kv_lora_rank, torch.tensor(req.block_table))
    return torch.cat([c, k_rot], dim=-1)[: req.num_computed]


def generate(llm, on: bool, **options) -> tuple[list[list[int]], int, tuple[int, int], dict | None, list]:
    """Each group's requests after the last group's finished: (tokens, tokens computed, (queries, hits),
    spec-decode counters, the MTP layer's cache of request 1 after each step it ran)."""
    prompts = [p for g in GROUPS for p in g]
    engine = llm.job_engine(prompts, [NEW] * len(prompts), enable_prefix_caching=on, **options)
    engine.metrics = metrics = AttentionMetrics("attn0", "m")
    out: list[list[int]] = [[] for _ in prompts]
    computed, i, seen = 0, 0, []
    for group in GROUPS:
        for p in group:
            on_output = lambda o, i=i: out[i].extend(o.new_token_ids)  # noqa: E731
            engine.add_request(Request(str(i), list(p), SamplingParams(), NEW, on_output, ignore_eos=True))
            i += 1
        while engine.has_unfinished():
            stats = engine.step()
            computed += stats.num_tokens if stats else 0
            if engine.spec is not None and (kv := mtp_kv(engine)) is not None:
                seen.append(kv)
    spec = engine.spec.stats.report() if engine.spec else None
    counted = (metrics.prefix_cache_queries._value.get(), metrics.prefix_cache_hits._value.get())  # what /metrics shows
    return out, computed, counted, spec, seen


@pytest.mark.parametrize(
    "family,config", [("longcat_flash", "zero_experts"), ("deepseek_v3", "grouped"), ("qwen3_moe", "sparse_step")]
)
def test_greedy_tokens_are_the_same_with_the_cache_and_fewer_are_computed(families, family, config):
    """MLA latents (LongCat-Flash, DeepSeek-V3) and GQA K/V (Qwen3-MoE)."""
    llm = afd.LLM(families.path(family, config), block_size=4)
    off, computed_off, counted_off, *_ = generate(llm, False)
    on, computed_on, (queries, hits), *_ = generate(llm, True)
    assert counted_off == (0, 0)
    assert on == off and all(len(t) == NEW for t in on)
    assert hits == 3 * 12 and queries == sum(len(p) for g in GROUPS for p in g)  # each later prompt: 3 blocks
    assert computed_on == computed_off - hits


def test_under_memory_pressure_evictions_and_preemptions_keep_the_tokens(tiny_checkpoint):
    """Six prompts sharing a prefix in a cache of 10 blocks, 4 at a time: cached blocks are evicted and
    requests preempted (and recomputed from what is still cached), with the tokens of the cache off."""
    llm = afd.LLM(tiny_checkpoint, block_size=4)
    prompts = [SHARED + [60 + i, 70 + i] for i in range(6)]  # 14 tokens, 20 with their output: 5 blocks

    def run(on: bool):
        engine = llm.job_engine([[1] * 36], [4], enable_prefix_caching=on)  # 40 tokens: 10 blocks
        engine.scheduler = engine.processor.scheduler = s = Scheduler(engine.runner.kv, 4, 64, on)
        out: list[list[int]] = [[] for _ in prompts]
        for i, p in enumerate(prompts):
            on_output = lambda o, i=i: out[i].extend(o.new_token_ids)  # noqa: E731
            engine.add_request(Request(str(i), list(p), SamplingParams(), NEW, on_output, ignore_eos=True))
        evicted = 0
        while engine.has_unfinished():
            cached = set(s.kv.allocator.cached.by_hash.values())
            engine.step()
            evicted += len(cached - set(s.kv.allocator.cached.by_hash.values()))
        assert s.kv.allocator.num_free == s.kv.allocator.num_blocks
        return out, s.num_preemptions, s.prefix.hits if s.prefix else 0, evicted

    off, *_ = run(False)
    on, preempted, hits, evicted = run(True)
    assert on == off and all(len(t) == NEW for t in on)
    assert hits > 0 and evicted > 0 and preempted > 0  # the hits let more in at once: decodes then preempt


@pytest.fixture(scope="module")
def mtp_ckpt(families, tmp_path_factory) -> str:
    from hf_mtp import add_mtp

    path = str(tmp_path_factory.mktemp("prefix_mtp") / "longcat_mtp")
    return add_mtp(families.path("longcat_flash", "zero_experts"), path, "longcat_flash", noise=0.1, damp=0.1)


def test_with_mtp_tokens_and_drafts_are_the_same_with_the_cache(mtp_ckpt):
    """The MTP layer's KV lives in the same blocks: a hit must bring the KV the MTP layer computes without
    the cache (at a block's last position it depends on the token after the block), so its cache and the
    drafts (and so what was accepted) equal those without it."""
    llm = afd.LLM(mtp_ckpt, block_size=4, speculative_tokens=2)
    off, computed_off, _, spec_off, kv_off = generate(llm, False)
    on, computed_on, (_, hits), spec_on, kv_on = generate(llm, True)
    assert on == off and spec_on == spec_off and spec_on["num_accepted_tokens"] > 0
    assert len(kv_on) == len(kv_off) > 0
    for a, b in zip(kv_on, kv_off):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # the shared prefix's last block ends before a different token in two of the three: 2 blocks, then 3
    assert hits == 8 + 8 + 12 and computed_on < computed_off


def test_the_flag_turns_it_off(tiny_checkpoint):
    from afd.config.flags import config_flags

    flag = config_flags()["enable_prefix_caching"]
    assert flag.name == "--enable-prefix-caching" and flag.key == "engine.enable_prefix_caching"
    llm = afd.LLM(tiny_checkpoint)
    assert llm.config.engine.enable_prefix_caching  # on by default, as vLLM's
    assert llm.job_engine([[1, 2]], [1], enable_prefix_caching=False).scheduler.prefix is None
    assert llm.job_engine([[1, 2]], [1]).scheduler.prefix is not None


@pytest.mark.slow  # an `afd serve` of two TP ranks; CI runs test-slow
def test_served_with_attention_tp_and_kvp_hits_and_keeps_hfs_tokens(families, tmp_path):
    """`afd serve --colocated --attention-tp 2 --kvp 2`: block tables reach the follower rank with each step,
    and with KVP a cached block serves only at its own position (pool i % 2): HF's greedy tokens on every
    request, hits counted on /metrics."""
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from cluster_helpers import post
    from hf_families import FAMILIES
    from metrics_text import total
    from serve_helpers import Served, free_port_run

    path = families.path("longcat_flash", "zero_experts")
    prompts = [p for g in GROUPS for p in g]
    want = [ids[:NEW] for ids, _ in FAMILIES["longcat_flash"].greedy(path, prompts, NEW)]
    url = f"http://127.0.0.1:{(port := free_port_run(1))}"
    argv = [path, "--port", str(port), "--colocated", "--attention-tp", "2", "--kvp", "2", "--block-size", "4"]
    s = Served(argv, tmp_path / "serve.log", [url])

    def complete(p):
        body = {"prompt": p, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        code, out = post(url, "/v1/completions", body)
        assert code == 200, out
        return out["choices"][0]["token_ids"]

    try:
        s.wait_ready()
        got = [complete(GROUPS[0][0])]
        with ThreadPoolExecutor(len(GROUPS[1])) as pool:
            got += list(pool.map(complete, GROUPS[1]))
        with urllib.request.urlopen(f"{url}/metrics") as r:
            metrics = r.read().decode()
    finally:
        assert s.stop() == 0
    assert got == want
    assert total(metrics, "afd_prefix_cache_hits_total") == 3 * 12
    assert total(metrics, "afd_prefix_cache_queries_total") == sum(len(p) for p in prompts)
