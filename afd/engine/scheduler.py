"""Continuous batching: which requests run in the next step, and how many of their tokens.

Plain Python over the KV block allocator. Each step first continues the running requests (one decode
token each, or the next chunk of a prompt being prefilled in chunks), then admits waiting requests while
the token budget, the sequence cap and free KV blocks allow. When a running request cannot get a KV
block, the most recently admitted one is preempted: its blocks are freed and it goes back to the front
of the queue, to be recomputed (prompt + what it generated) when there is room.
"""

from __future__ import annotations

from collections import deque

from afd.engine.kv_cache import KVCache
from afd.engine.request import Request, Status


class Scheduler:
    def __init__(self, kv: KVCache, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs, self.max_tokens = max_num_seqs, max_num_batched_tokens
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
        self.kv.allocator.free(req.block_table)
        req.block_table, req.num_computed, req.status = [], 0, Status.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def schedule(self) -> list[tuple[Request, int]]:
        budget = self.max_tokens
        out: list[tuple[Request, int]] = []
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
            out.append((req, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_uncomputed, budget)
            if not self._fits(req, n):
                break
            self.waiting.popleft()
            self.kv.grow(req.block_table, req.num_computed + n)
            req.status = Status.RUNNING
            self.running.append(req)
            out.append((req, n))
            budget -= n
        return out

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.allocator.free(req.block_table)
        req.block_table, req.status = [], Status.FINISHED
