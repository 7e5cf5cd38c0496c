"""Paged KV cache: fixed-size blocks handed out by a plain-Python allocator; what a block holds is the model
family's state kinds (afd.model.state_spec: its config's `state_kinds`).

The state contract. Whatever a family keeps per sequence lives in this cache, addressed by position through the
sequence's block tables: the values in a slot may depend only on the tokens at or before the positions it covers
(slot p of a per-token kind: tokens <= p; slot w of a kind compressed at rate r: tokens < (w + 1) * r). That one
rule is what lets a single allocator (this one) take, preempt (free, then recompute), free and share (prefix
caching) every kind alike. A family with one full-history per-token kind (MLA latents, K/V heads) keeps the one
tensor [layers, blocks, block_size, ...] of its kv_cache_shape and one block table per sequence, as before kinds.
A family with more kinds (DeepSeek-V4: a sliding window of per-token planes, and compressed entries) gets a pool
of equal pages that every kind draws from, a block table per kind (afd.model.state_spec.BlockTable), and its
window's blocks given back as the sequence moves past them (`release_window`, at each schedule: vLLM's
SlidingWindowManager).
Such a family runs without prefix caching (afd.engine.scheduler) and without KVP (a window's blocks are not a
round-robin share of the sequence's)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from afd.engine.prefix_cache import CachedBlocks
from afd.model.config import ConfigError, ModelConfig
from afd.model.state_spec import NULL_BLOCK, BlockTable, PagedLayer, StateLayout


class OutOfBlocks(RuntimeError):
    """The cache has fewer free blocks than a request needs."""


class BlockAllocator:
    """Free-list allocator of block ids [0, num_blocks), with reference counts: a block in several
    block tables (a shared prefix, afd.engine.prefix_cache) goes back only when the last one lets go.

    With `pools` N > 1 (KVP) block g lives on KV-parallel rank g % N (as local block g // N), and the
    i-th block of a sequence comes from pool i % N: every rank holds its round-robin share of every
    sequence, so a sequence may be N times longer than one rank's cache. A cached block is reused only at
    the position it was computed at, so it keeps that rule.

    A block no table holds is free: on its pool's free list, or, when it holds a cached prefix, evictable
    (`cached`). Allocation takes the free list first and evicts the pool's least recently used cached
    block only when that is empty: caching costs no request a block."""

    def __init__(self, num_blocks: int, pools: int = 1):
        self.num_blocks, self.pools = num_blocks - num_blocks % pools, pools
        # pop() hands out low ids first
        self._free = [list(range(self.num_blocks - self.pools + p, -1, -self.pools)) for p in range(pools)]
        self._refs = [0] * self.num_blocks
        self.cached = CachedBlocks(pools)

    def _available(self, pool: int) -> int:
        return len(self._free[pool]) + len(self.cached.evictable[pool])

    @property
    def num_free(self) -> int:
        """Blocks a request can get: free ones and evictable cached ones."""
        return sum(self._available(p) for p in range(self.pools))

    def pool_usage(self) -> list[float]:
        """Fraction of each KV-parallel rank's blocks in use."""
        per = self.num_blocks // self.pools
        return [1.0 - self._available(p) / per for p in range(self.pools)]

    def _need(self, have: int, n: int) -> list[int]:
        """Blocks each pool gives a table of `have` blocks that grows by `n`."""
        need = [0] * self.pools
        for i in range(have, have + n):
            need[i % self.pools] += 1
        return need

    def can_allocate(self, have: int, n: int, reuse: Sequence[int] = ()) -> bool:
        """Whether a table of `have` blocks can grow by n; `reuse`: cached blocks it is about to take
        (`share`), which then are no longer there to evict."""
        need = self._need(have, n)
        for g in reuse:
            if self._refs[g] == 0:
                need[g % self.pools] += 1
        return all(k <= self._available(p) for p, k in enumerate(need))

    def allocate(self, n: int, have: int = 0) -> list[int]:
        """n more blocks for a table that holds `have`."""
        if not self.can_allocate(have, n):
            raise OutOfBlocks(f"need {n} KV blocks, {self.num_free} free of {self.num_blocks}")
        out = []
        for i in range(have, have + n):
            pool = i % self.pools
            g = self._free[pool].pop() if self._free[pool] else self.cached.evict(pool)
            assert g is not None  # can_allocate counted it
            self._refs[g] = 1
            out.append(g)
        return out

    def share(self, blocks: list[int]) -> None:
        """One more table holds these (cached) blocks."""
        for g in blocks:
            if self._refs[g] == 0:
                self.cached.unpark(g)
            self._refs[g] += 1

    def free(self, blocks: list[int]) -> None:
        """A table lets go of its blocks. The last block first: among a sequence's cached blocks, the
        tail ones are evicted first (vLLM's order), and the head ones, which more prompts share, last."""
        for g in reversed(blocks):
            assert self._refs[g] > 0, f"KV block {g} freed more often than it was taken"
            self._refs[g] -= 1
            if self._refs[g] == 0 and not self.cached.park(g):
                self._free[g % self.pools].append(g)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class KVCache:
    """[num_cache_layers, ...]: the family's layout, with a block and a slot dimension inside; or, for a family
    with several state kinds, the page pool [1, pages, page values] that PagedLayer views per layer and kind."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kvp: int = 1,
        pages: int | None = None,
    ):
        """num_blocks: of the whole node; with kvp N each rank's tensor holds num_blocks / N of them. For a family
        with several kinds, blocks of tokens in full: the pool adds the compressed kinds' pages
        (StateLayout.pool_pages, an average), unless `pages` gives the pool's size (a job's exact need)."""
        self.block_size = block_size
        self.layout = StateLayout(cfg.state_kinds(), block_size)
        self.paged = self.layout.paged_pool
        if self.paged:
            if kvp > 1:
                raise ConfigError(
                    f"{cfg.model_type} keeps state kinds ({', '.join(k.name for k in self.layout.kinds)}) that KV "
                    "parallelism does not split: run it with kvp 1"
                )
            num_blocks = pages if pages is not None else self.layout.pool_pages(num_blocks)
        self.allocator = BlockAllocator(num_blocks, kvp)
        local = self.allocator.num_blocks // kvp
        self.data = torch.zeros(cfg.kv_cache_shape(local, block_size), dtype=dtype, device=device)

    def layer(self, i: int) -> torch.Tensor | PagedLayer:
        return PagedLayer(self.data[0], self.layout, i) if self.paged else self.data[i]

    def new_table(self) -> list[int]:
        """An empty block table of this cache's kinds."""
        return BlockTable(kinds={k.name: [] for k in self.layout.kinds[1:]}) if self.paged else []

    def _tables(self, table: list[int]) -> list[list[int]]:
        """Each kind's block table of a sequence (an empty one for a kind it has none of yet)."""
        kinds = table.kinds if isinstance(table, BlockTable) else {}
        return [table, *(kinds.get(k.name, []) for k in self.layout.kinds[1:])]

    def _more(self, table: list[int], num_tokens: int) -> list[int]:
        """Blocks each kind's table needs to hold num_tokens tokens."""
        return [max(0, self.layout.blocks_for(k, num_tokens) - len(t)) for k, t in enumerate(self._tables(table))]

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Extend a sequence's block tables in place so that they can hold num_tokens tokens."""
        if self.paged and not isinstance(table, BlockTable):
            raise TypeError("a cache of several state kinds grows the tables of new_table() only")
        for t, need in zip(self._tables(table), self._more(table, num_tokens)):
            if need > 0:
                t.extend(self.allocator.allocate(need, len(t)))

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        return self.allocator.can_allocate(len(table), sum(self._more(table, num_tokens)))

    def free(self, table: list[int]) -> None:
        """Every block of a sequence's tables goes back."""
        for t in self._tables(table):
            self.allocator.free([g for g in t if g != NULL_BLOCK])

    def trim(self, table: list[int], num_tokens: int) -> None:
        """Give back the blocks past what num_tokens tokens need (they held only rejected drafts)."""
        for k, t in enumerate(self._tables(table)):
            keep = self.layout.blocks_for(k, num_tokens)
            self.allocator.free([g for g in t[keep:] if g != NULL_BLOCK])
            del t[keep:]

    def release_window(self, table: list[int], num_tokens: int) -> int:
        """Give back the window's blocks no later token reads, once num_tokens are computed; their entries become
        NULL_BLOCK (positions keep their blocks' indices). Returns how many went back."""
        gone, j = [], min(len(table), self.layout.first_needed(num_tokens)) - 1
        while j >= 0 and table[j] != NULL_BLOCK:  # the given-back ones are a prefix: O(blocks given back)
            gone.append(j)
            j -= 1
        self.allocator.free([table[j] for j in gone])
        for j in gone:
            table[j] = NULL_BLOCK
        return len(gone)

    def max_tokens(self, pages: int, chunk: int, limit: int) -> int:
        """The longest sequence (at most `limit` tokens) whose state fits `pages` pages when computed `chunk`
        tokens a step (StateLayout.peak_pages): pages x block_size for full history; far more for a window
        family, whose windows go back as it advances."""
        if not self.paged:
            return min(limit, pages * self.block_size)
        lo, hi = 0, limit  # peak_pages grows with the tokens: the last that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.layout.peak_pages(mid, chunk) <= pages else (lo, mid - 1)
        return lo

    def usage(self) -> float:
        a = self.allocator
        return 1.0 - a.num_free / a.num_blocks


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype_bytes: int) -> int:
    """Bytes per block of tokens in full; with several kinds, the pages they take on average (pool_pages)."""
    n = 1
    for d in cfg.kv_cache_shape(1, block_size):
        n *= d
    layout = StateLayout(cfg.state_kinds(), block_size)
    if layout.paged_pool:
        n = -(-n * layout.pool_pages(1024) // 1024)
    return n * dtype_bytes


@dataclass
class CacheConfig:
    """Paged KV cache layout."""

    block_size: int = 16
    """Tokens per KV block."""
    num_blocks: int = 0
    """Blocks per attention layer; 0 sizes the cache from `memory_budget_bytes`."""
    memory_budget_bytes: int = 256 << 20
    """Bytes the KV cache may take when `num_blocks` is 0."""

    def __post_init__(self):
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        if self.num_blocks < 0 or self.memory_budget_bytes <= 0:
            raise ConfigError("num_blocks must be >= 0 and memory_budget_bytes positive")

    def resolve_num_blocks(self, model: ModelConfig, dtype_bytes: int) -> int:
        if self.num_blocks:
            return self.num_blocks
        return max(1, self.memory_budget_bytes // bytes_per_block(model, self.block_size, dtype_bytes))
