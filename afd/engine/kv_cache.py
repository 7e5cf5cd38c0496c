"""Paged KV cache: fixed-size blocks handed out by a plain-Python allocator; what a block holds per
token (MLA latents, or K and V heads) is the model family's `kv_cache_shape`.

The state contract. Whatever a family keeps per sequence lives in this one tensor, [layers, blocks, block_size,
...], and is addressed by position through the sequence's block table: the values in slot p may depend on the
tokens at positions <= p only. That one rule is what lets a single allocator (this one) take, preempt (free,
then recompute), free and share (prefix caching) every kind of state alike. MLA latents and K/V heads are one
slot per token. DeepSeek-V4 (afd.model.deepseek_v4.state) carves each block of a layer into two planes under
the same block table: per-token (sliding-window keys, compressor projections) and per compressed position
(entries: block_size / rate slots a block). Its token planes keep full history, correct under every engine
path but more than V4 needs at steady state (a window ring and the open windows' projections): state per
sequence beside the block table is issue 31's next step, and what linear-attention families will need too."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from afd.engine.prefix_cache import CachedBlocks
from afd.model.config import ConfigError, ModelConfig


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
    """[num_cache_layers, ...]: the family's layout, with a block and a slot dimension inside."""

    def __init__(
        self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device, kvp: int = 1
    ):
        """num_blocks: of the whole node; with kvp N each rank's tensor holds num_blocks / N of them."""
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks, kvp)
        local = self.allocator.num_blocks // kvp
        self.data = torch.zeros(cfg.kv_cache_shape(local, block_size), dtype=dtype, device=device)

    def layer(self, i: int) -> torch.Tensor:
        return self.data[i]

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Extend a sequence's block table in place so that it can hold num_tokens tokens."""
        need = blocks_needed(num_tokens, self.block_size) - len(table)
        if need > 0:
            table.extend(self.allocator.allocate(need, len(table)))

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        return self.allocator.can_allocate(len(table), max(0, blocks_needed(num_tokens, self.block_size) - len(table)))

    def usage(self) -> float:
        a = self.allocator
        return 1.0 - a.num_free / a.num_blocks


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype_bytes: int) -> int:
    n = 1
    for d in cfg.kv_cache_shape(1, block_size):
        n *= d
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
