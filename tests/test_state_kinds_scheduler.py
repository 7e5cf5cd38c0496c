"""The scheduler over a cache of several state kinds (DeepSeek-V4's tiny config, no model run): before each step
it gives back the window's pages no later token reads; it preempts and finishes by freeing every kind's pages;
prefix caching, asked for, is off."""

from __future__ import annotations

import torch
from hf_deepseek_v4 import BASE

from afd.engine.kv_cache import KVCache
from afd.engine.messages import StepPlan
from afd.engine.request import Request, Status
from afd.engine.sampling import SamplingParams
from afd.engine.scheduler import Scheduler
from afd.model.registry import config_from_hf
from afd.model.state_spec import NULL_BLOCK, BlockTable

CSA = "compressed_sparse_attention"


def _sched(token_blocks: int, max_seqs: int = 4, budget: int = 64) -> Scheduler:
    cfg = config_from_hf({"model_type": "deepseek_v4", **BASE})  # lookback 15, CSA rate 4, HCA rate 16
    kv = KVCache(cfg, token_blocks, 4, torch.float32, torch.device("cpu"))
    return Scheduler(kv, max_seqs, budget, prefix_caching=True)


def _req(rid: str, n_prompt: int) -> Request:
    return Request(rid, list(range(n_prompt)), SamplingParams(), 100, lambda out: None, ignore_eos=True)


def _run(s: Scheduler, plan: StepPlan) -> None:
    sampled = [[1] if e.samples else None for e in plan]
    s.update(plan, sampled)
    for e, toks in zip(plan, sampled):
        e.request.output_ids += toks or []


def test_window_pages_go_back_before_each_step_and_finish_frees_every_kind():
    s = _sched(64)
    assert s.prefix is None  # asked for, turned off: the window's early pages are gone
    a, total = s.kv.allocator, s.kv.allocator.num_free
    r = _req("a", 60)
    s.add(r)
    _run(s, s.schedule())  # the whole prompt: 15 window pages, 15 CSA entries (24 a page), 3 HCA (72 a page)
    table = r.block_table
    assert isinstance(table, BlockTable) and len(table) == 15 and total - a.num_free == 15 + 1 + 1
    _run(s, s.schedule())  # 61 computed: positions < 46 are read no more, blocks 0 .. 10 go back
    assert table[:11] == [NULL_BLOCK] * 11 and NULL_BLOCK not in table[11:]
    assert total - a.num_free == 5 + 1 + 1 and len(table.kinds[CSA]) == 1
    s.finish(r)
    assert a.num_free == total and r.status is Status.FINISHED


def test_preemption_frees_every_kinds_pages_and_recomputes_from_nothing():
    s = _sched(8, budget=200)  # 14 pages: 8, and 3 for each compressed kind
    a, total = s.kv.allocator, s.kv.allocator.num_free
    first, second = _req("a", 20), _req("b", 20)
    s.add(first)
    s.add(second)
    _run(s, s.schedule())
    assert [r.status for r in (first, second)] == [Status.RUNNING, Status.RUNNING]
    assert total - a.num_free == 2 * (5 + 1 + 1)
    for _ in range(90):  # windows stay at 5 pages; at 96 tokens a CSA page more each: 16 > 14, b gives way
        _run(s, s.schedule())
        if s.num_preemptions:
            break
    assert s.num_preemptions >= 1 and second.status is Status.WAITING
    assert second.block_table == [] and second.num_computed == 0
    held = total - a.num_free
    table = first.block_table
    assert held == sum(g != NULL_BLOCK for g in table) + sum(len(t) for t in table.kinds.values())
