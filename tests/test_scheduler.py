"""Continuous batching in plain Python: budgets, chunked prefill, preemption and recompute."""

from __future__ import annotations

import torch

from afd.engine.kv_cache import KVCache
from afd.engine.messages import StepPlan
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


def _run(s: Scheduler, plan: StepPlan) -> None:
    """What the engine's step does after the forward pass: a finished chunk samples a token."""
    sampled = [[1] if e.samples else None for e in plan]
    s.update(plan, sampled)
    for e, toks in zip(plan, sampled):
        e.request.output_ids += toks or []


def _ids(plan: StepPlan) -> list[tuple[str, int]]:
    return [(e.request.request_id, e.num_tokens) for e in plan]


def test_long_prompt_is_prefilled_in_chunks_next_to_decodes():
    s = _sched(blocks=32, budget=8)
    a, b = _req("a", 3), _req("b", 20)
    s.add(a)
    s.add(b)
    first = s.schedule()
    assert _ids(first) == [("a", 3), ("b", 5)]
    _run(s, first)
    second = s.schedule()
    assert _ids(second) == [("a", 1), ("b", 7)]  # decode + next chunk


def test_max_num_seqs_and_budget():
    s = _sched(blocks=32, max_seqs=2, budget=100)
    for i in range(3):
        s.add(_req(str(i), 2))
    assert [rid for rid, _ in _ids(s.schedule())] == ["0", "1"]
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
    assert _ids(batch) == [("a", 1)]
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


def test_the_plan_says_which_drafts_run_and_update_rolls_rejected_ones_back():
    """A request with drafts gets them in the plan as far as the budget allows, decided once; after the
    step only accepted drafts count as cached, and blocks that held only rejected ones are freed."""
    s = _sched(blocks=8, budget=3)
    a = _req("a", 3)
    s.add(a)
    _run(s, s.schedule())  # prefill: 3 cached, a token sampled (4 tokens, the last not cached)
    a.draft = torch.tensor([7, 8, 9])
    plan = s.schedule()  # budget 3: the last token and two of the three drafts
    (e,) = plan.seqs
    assert (e.start, e.num_tokens, e.num_drafts, e.samples, e.num_logits) == (3, 3, 2, True, 3)
    assert e.drafts is not None and e.drafts.tolist() == [7, 8]
    seq = e.step_seq()  # the drafts stand in for placeholders: they stay on the device
    assert seq.token_ids == [1, 0, 0] and seq.drafts is e.drafts and len(a.block_table) == 2  # positions 3..5
    s.update(plan, [[7, 5]])  # the first draft accepted, the second rejected, 5 the target's own
    assert a.num_computed == 5 and a.draft is None and len(a.block_table) == 2
    a.output_ids += [7, 5]
    s.add(b := _req("b", 1))
    plan = s.schedule()
    assert _ids(plan) == [("a", 1), ("b", 1)]
    _run(s, plan)
    assert a.num_computed == 6 and len(a.block_table) == 2
    a.draft = torch.tensor([4, 4])
    plan = s.schedule()  # a: its last token and both drafts, positions 6..8: a third block; no budget for b
    assert _ids(plan) == [("a", 3)] and plan.seqs[0].num_drafts == 2 and len(a.block_table) == 3
    s.update(plan, [[1]])  # both rejected: the third block held only drafts
    assert a.num_computed == 7 and len(a.block_table) == 2 and b.num_computed == 1
    assert s.kv.allocator.num_free == 8 - 2 - 1
