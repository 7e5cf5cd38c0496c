"""Automatic prefix caching (afd.engine.prefix_cache): the allocator's reference counts and per-pool LRU
eviction, the scheduler's hits, misses and preemptions, and `afd bench --shared-prefix-len`'s prompts.
The engine with the cache on and off: tests/test_prefix_cache_engine.py."""

from __future__ import annotations

import pytest
from test_scheduler import _req, _run, _sched

from afd.engine.kv_cache import BlockAllocator
from afd.engine.prefix_cache import block_hash
from afd.engine.request import Request, Status

# ---- the allocator ---------------------------------------------------------------------------------------


def test_shared_blocks_go_back_with_the_last_holder_and_cached_ones_stay_until_needed():
    a = BlockAllocator(4)
    x, y = a.allocate(2)
    assert a.cached.register(x, b"x") and a.cached.register(y, b"y")
    assert not a.cached.register(a.allocate(1)[0], b"x")  # the same content twice: the second stays private
    a.share([x])
    a.free([x, y])
    assert a.num_free == 2 and a.cached.evictable[0] == {y: None}  # x is still held, y cached and evictable
    a.free([x])
    assert a.num_free == 3 and a.cached.by_hash == {b"x": x, b"y": y}
    assert a.allocate(1) == [3]  # the free list first: cached blocks are evicted only under pressure
    a.share([x])  # a hit takes x back from the evictable ones
    assert a.num_free == 1 and a.can_allocate(0, 1) and not a.can_allocate(0, 1, reuse=[y])
    assert a.allocate(1) == [y] and a.cached.by_hash == {b"x": x}  # evicted: its hash is forgotten


def test_the_tail_of_a_sequence_is_evicted_first():
    a = BlockAllocator(3)
    table = a.allocate(3)
    for g in table:
        a.cached.register(g, bytes([g]))
    a.free(table)
    assert a.allocate(1) == [table[2]] and a.allocate(1) == [table[1]]


def test_eviction_is_per_pool_and_keeps_a_blocks_position():
    """KVP: block g lives on pool g % N; a table's i-th block must come from pool i % N, also when the
    pool's free list is empty and a cached block of that pool is evicted."""
    a = BlockAllocator(4, pools=2)
    table = a.allocate(4)  # [0, 1, 2, 3]: pools 0, 1, 0, 1
    a.cached.register(table[0], b"p0")
    a.cached.register(table[1], b"p1")
    a.free(table[:2])
    assert a.pool_usage() == [0.5, 0.5]
    assert not a.can_allocate(0, 1, reuse=[table[0]])  # pool 0's only available block is the one reused
    assert a.can_allocate(1, 1, reuse=[table[0]])  # index 1 comes from pool 1
    assert a.allocate(1, have=1) == [table[1]] and a.cached.by_hash == {b"p0": table[0]}


def test_hashes_chain():
    h = block_hash(b"", [1, 2])
    assert block_hash(h, [3, 4]) != block_hash(block_hash(b"", [9, 2]), [3, 4]) and len(h) == 32


# ---- the scheduler --------------------------------------------------------------------------------------


def _finish(s, req) -> None:
    while req.status is not Status.FINISHED:
        plan = s.schedule()
        _run(s, plan)
        if len(req.output_ids) >= 2:
            s.finish(req)


def _prompt(req, ids) -> Request:
    req.prompt_ids = list(ids)
    return req


def test_a_shared_prefix_hits_and_leaves_the_last_token_to_compute():
    s = _sched_with_cache()  # blocks of 4 tokens
    a = _prompt(_req("a", 0), range(10))
    s.add(a)
    _finish(s, a)  # 10 prompt + 2 output tokens, 11 computed: blocks 0, 1 cached (the third is not full)
    assert s.kv.allocator.num_free == 16 and len(s.kv.allocator.cached.by_hash) == 2
    b = _prompt(_req("b", 0), [*range(8), 50, 51])
    c = _prompt(_req("c", 0), range(8))  # all 8 cached, yet its last token must run for its logits
    d = _prompt(_req("d", 0), [9, *range(1, 10)])  # differs in its first token: a miss
    for r in (b, c, d):
        s.add(r)
    plan = s.schedule()
    assert [(e.request.request_id, e.start, e.num_tokens) for e in plan] == [("b", 8, 2), ("c", 4, 4), ("d", 0, 10)]
    assert b.block_table[:2] == a_blocks(s, range(8)) and c.block_table[0] == b.block_table[0]
    assert (s.prefix.queries, s.prefix.hits) == (10 + 10 + 8 + 10, 8 + 4)


def _sched_with_cache(blocks: int = 16, budget: int = 32, lookahead: int = 0):
    s = _sched(blocks=blocks, budget=budget)
    from afd.engine.prefix_cache import PrefixCache

    s.prefix = PrefixCache(s.kv.allocator.cached, s.kv.block_size, lookahead)
    return s


def a_blocks(s, ids) -> list[int]:
    """The cached blocks of `ids` (whole blocks)."""
    h, out = b"", []
    ids = list(ids)
    for k in range(len(ids) // 4):
        h = block_hash(h, ids[4 * k : 4 * k + 4])
        out.append(s.kv.allocator.cached.by_hash[h])
    return out


def test_a_preempted_request_recomputes_from_its_own_cached_blocks():
    s = _sched_with_cache(blocks=6, budget=100)
    a, b = _prompt(_req("a", 0), range(11)), _prompt(_req("b", 0), range(20, 32))
    s.add(a)
    s.add(b)
    _run(s, s.schedule())  # a: 3 blocks, b: 3 blocks, all used
    _run(s, s.schedule())  # a decodes; b's 13th token needs a 4th block: b, the newest, is preempted
    assert s.num_preemptions == 1 and b.status is Status.WAITING and not b.block_table
    s.finish(a)
    plan = s.schedule()  # b: 13 tokens; its first 3 blocks (12 tokens) were cached at the preemption
    (e,) = plan.seqs
    assert (e.start, e.num_tokens) == (12, 1) and s.prefix.hits == 12


def test_with_mtp_a_block_waits_for_the_token_after_it_and_for_the_drafting():
    """lookahead 1: a block's hash covers the next token, and a block is registered only once the MTP
    module ran over it, so not from the step a request finishes in (it drafts nothing)."""
    s = _sched_with_cache(lookahead=1)
    a = _prompt(_req("a", 0), range(8))
    s.add(a)
    _run(s, s.schedule())  # 8 computed, a token sampled, then finished before any drafting
    s.finish(a)
    assert not s.kv.allocator.cached.by_hash
    b = _prompt(_req("b", 0), range(9))
    s.add(b)
    _run(s, s.schedule())
    s.schedule()  # b's drafting ran: blocks 0 and 1, whose next tokens (4 and 8) are known
    assert len(s.kv.allocator.cached.by_hash) == 2
    c = _prompt(_req("c", 0), [*range(8), 99, 5])  # token 8 differs: block 1 is not c's
    s.add(c)
    s.schedule()
    assert c.num_computed == 4


def test_bench_prompts_share_a_prefix():
    from test_bench_serve import _parse

    from afd.bench import serve as bench_serve

    argv = ["--num-prompts", "8", "--random-input-len", "5", "--vocab-size", "100", "--random-output-len", "2"]
    plain = bench_serve.sample_requests(_parse(argv))
    reqs = bench_serve.sample_requests(_parse([*argv, "--shared-prefix-len", "16"]))
    assert all(p[:16] == reqs[0][0][:16] and p[16:] == q for (p, _), (q, _) in zip(reqs, plain))
    assert len({tuple(p[16:]) for p, _ in reqs}) == 8
    with pytest.raises(SystemExit):  # refused as the flag is parsed (afd.bench.common.at_least)
        _parse([*argv, "--shared-prefix-len", "-1"])
