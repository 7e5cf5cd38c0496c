"""Continuous batching in plain Python: budgets, chunked prefill, preemption and recompute."""

from __future__ import annotations

import torch

from afd.engine.kv_cache import KVCache
from afd.engine.request import Request, Status
from afd.engine.sampling import SamplingParams
from afd.engine.scheduler import Scheduler
from afd.model.longcat_flash.config import LongcatFlashConfig

CFG = LongcatFlashConfig(
    vocab_size=10,
    hidden_size=4,
    num_layers=1,
    num_attention_heads=1,
    ffn_hidden_size=4,
    q_lora_rank=2,
    kv_lora_rank=2,
    qk_nope_head_dim=2,
    qk_rope_head_dim=2,
    v_head_dim=2,
    moe_topk=1,
    n_routed_experts=2,
    expert_ffn_hidden_size=2,
)


def _sched(blocks: int, max_seqs: int = 8, budget: int = 16) -> Scheduler:
    kv = KVCache(CFG, blocks, 4, torch.float32, torch.device("cpu"))
    return Scheduler(kv, max_seqs, budget)


def _req(rid: str, n_prompt: int) -> Request:
    return Request(rid, list(range(n_prompt)), SamplingParams(), 100, lambda out: None)


def _run(s: Scheduler, batch) -> None:
    """What the engine's update does: the scheduled tokens are now cached; a finished chunk samples."""
    for req, n in batch:
        req.num_computed += n
        if req.num_computed == req.num_tokens:
            req.output_ids.append(1)


def test_long_prompt_is_prefilled_in_chunks_next_to_decodes():
    s = _sched(blocks=32, budget=8)
    a, b = _req("a", 3), _req("b", 20)
    s.add(a)
    s.add(b)
    first = s.schedule()
    assert [(r.request_id, n) for r, n in first] == [("a", 3), ("b", 5)]
    _run(s, first)
    second = s.schedule()
    assert [(r.request_id, n) for r, n in second] == [("a", 1), ("b", 7)]  # decode + next chunk


def test_max_num_seqs_and_budget():
    s = _sched(blocks=32, max_seqs=2, budget=100)
    for i in range(3):
        s.add(_req(str(i), 2))
    assert [r.request_id for r, _ in s.schedule()] == ["0", "1"]
    assert [r.request_id for r in s.waiting] == ["2"]


def test_preemption_frees_blocks_and_requeues_for_recompute():
    s = _sched(blocks=4, budget=100)  # 16 token slots
    a, b = _req("a", 7), _req("b", 8)
    s.add(a)
    s.add(b)
    _run(s, s.schedule())  # a: 2 blocks, b: 2 blocks, all used
    assert s.kv.allocator.num_free == 0
    batch = s.schedule()  # b's 9th token needs a 3rd block; b is the newest, so b itself is preempted
    assert s.num_preemptions == 1
    assert [r.request_id for r, _ in batch] == ["a"]
    assert b.status is Status.WAITING and b.num_computed == 0 and not b.block_table
    assert s.waiting[0] is b and b.output_ids == [1]  # keeps what it generated; recomputes prompt + output


def test_finish_returns_blocks():
    s = _sched(blocks=8)
    a = _req("a", 9)
    s.add(a)
    s.schedule()
    assert s.kv.allocator.num_free == 5
    s.finish(a)
    assert s.kv.allocator.num_free == 8 and not s.has_work()
