"""Continuous batching: which requests run in the next step, and how many of their tokens.

Plain Python over the KV block allocator. Each step first continues the running requests (one decode
token each, or the next chunk of a prompt being prefilled in chunks), then admits waiting requests while
the token budget, the sequence cap and free KV blocks allow. When a running request cannot get a KV
block, the most recently admitted one is preempted: its blocks are freed and it goes back to the front
of the queue, to be recomputed (prompt + what it generated) when there is room.

The plan (afd.engine.messages.StepPlan) says per request how many tokens run and which drafts among
them the step verifies (speculative decoding): decided here, once. After the step `update` moves each
request's cached tokens past what the step kept and gives back the KV blocks that held only rejected
drafts; the MTP module asks `reserve` for the room its chained drafts write.

With prefix caching (afd.engine.prefix_cache) a request admitted with nothing computed, new or preempted,
starts from the cached blocks of its longest known prefix; blocks are registered once their KV is final:
a running request's at each schedule, a finishing one's when it finishes.

A family with several state kinds (afd.model.state_spec, DeepSeek-V4) has a block table per kind, grown, trimmed
and freed together (KVCache); before each step the pages of its window that no later token reads go back to
the allocator, and prefix caching is off for it (its early window pages are gone, so a prefix's state is not
all still there to share).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence

from afd.engine.kv_cache import KVCache, OutOfBlocks, blocks_needed
from afd.engine.messages import ScheduledSeq, StepPlan
from afd.engine.prefix_cache import PrefixCache
from afd.engine.request import Request, Status

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        kv: KVCache,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefix_caching: bool = False,
        lookahead: int = 0,
    ):
        """prefix_caching: reuse cached blocks of earlier prompts (engine.enable_prefix_caching); lookahead:
        1 with an MTP module, whose KV at a block's end depends on the next token (afd.engine.prefix_cache)."""
        self.kv = kv
        self.max_num_seqs, self.max_tokens = max_num_seqs, max_num_batched_tokens
        if prefix_caching and kv.paged:
            # A window's early blocks go back as a sequence advances, so a cached prefix would miss the state
            # its tail needs; vLLM shares what is still held, the simpler correct choice here is not to share.
            log.warning(  # a user who asked for it (the default) should see why it is not there
                "prefix caching off: the model keeps state kinds (%s), whose windows a cached prefix would miss",
                ", ".join(kv.layout.names),
            )
            prefix_caching = False
        self.prefix = PrefixCache(kv.allocator.cached, kv.block_size, lookahead) if prefix_caching else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _fits(self, req: Request, n: int) -> bool:
        return self.kv.can_grow(req.block_table, req.num_computed + n)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.block_table)
        req.block_table, req.num_computed, req.status = [], 0, Status.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def schedule(self) -> StepPlan:
        budget = self.max_tokens
        out: list[ScheduledSeq] = []
        for req in self.running:
            # before the step, as vLLM's SlidingWindowManager: the last step's tokens were all read (MTP too)
            self.kv.release_window(req.block_table, req.num_computed)
            if self.prefix is not None:
                self.prefix.scheduled(req)
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted while making room for an earlier one
                continue
            n = min(req.num_uncomputed, budget)
            while not self._fits(req, n) and self.running[-1] is not req:
                self._preempt(self.running[-1])
            if not self._fits(req, n):
                self._preempt(req)
                continue
            self.kv.grow(req.block_table, req.num_computed + n)
            out.append(_scheduled(req, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit = self._lookup(req)
            cached = len(hit) * self.kv.block_size
            n = min(req.num_uncomputed - cached, budget)
            more = blocks_needed(req.num_computed + cached + n, self.kv.block_size) - len(req.block_table) - len(hit)
            if not (self.kv.allocator.can_allocate(len(hit), more, hit) if hit else self._fits(req, n)):
                break
            self.waiting.popleft()
            if not req.block_table:
                req.block_table = self.kv.new_table()
            if self.prefix is not None and not req.block_table:  # nothing computed: it looked its prefix up
                self.kv.allocator.share(hit)
                req.block_table, req.num_computed = list(hit), cached
                self.prefix.admitted(req, hit)
            self.kv.grow(req.block_table, req.num_computed + n)
            req.status = Status.RUNNING
            self.running.append(req)
            out.append(_scheduled(req, n))
            budget -= n
        return StepPlan(tuple(out))

    def update(self, plan: StepPlan, sampled: Sequence[list[int] | None]) -> None:
        """After the step: `sampled` holds per plan entry the tokens it emits (its accepted drafts, then
        one more), or None. A request's computed tokens count as cached, a draft's only once accepted;
        KV blocks past the cached tokens (they held only rejected drafts) go back to the allocator."""
        for s, toks in zip(plan, sampled):
            req = s.request
            req.num_computed = s.start + s.num_tokens - s.num_drafts
            if toks:
                req.num_computed += len(toks) - 1
            req.draft = None
            if req.status is Status.RUNNING:
                self.kv.trim(req.block_table, req.num_computed)

    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Room in the request's block table for num_tokens (False: no free blocks; nothing changes)."""
        try:
            self.kv.grow(req.block_table, num_tokens)
            return True
        except OutOfBlocks:
            return False

    def _lookup(self, req: Request) -> list[int]:
        """The cached blocks a waiting request starts from (none without prefix caching). A waiting request
        has nothing computed: new, or preempted (its blocks freed)."""
        if self.prefix is None or req.block_table:
            return []
        return self.prefix.lookup(req)

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.prefix is not None:
            self.prefix.register(req, req.num_computed)
            self.prefix.forget(req)
        self.kv.free(req.block_table)
        req.block_table, req.status = [], Status.FINISHED


def _scheduled(req: Request, n: int) -> ScheduledSeq:
    """req runs n tokens: its uncached ones, then as many of its drafts as fit."""
    d = max(0, req.num_computed + n - req.num_tokens)
    drafts = req.draft[:d] if d and req.draft is not None else None
    return ScheduledSeq(req, req.num_computed, n, d, req.num_computed + n - d == req.num_tokens, drafts)
