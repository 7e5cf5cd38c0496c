"""Automatic prefix caching, as vLLM's (https://docs.vllm.ai/en/latest/design/prefix_caching/): a full
KV block is named by a chained hash of the token ids up to its end, so a request whose prompt starts like
an earlier one's reuses that one's blocks instead of computing them again.

Two parts. `CachedBlocks` is the allocator's side (afd.engine.kv_cache.BlockAllocator): which block holds
which hash, and the cached blocks no request holds (refcount 0), kept per KV pool in LRU order and evicted
only when the pool's free list is empty. `PrefixCache` is the scheduler's side: each request's block
hashes, the lookup when a request is admitted with nothing computed (new, or preempted), and registering
the blocks whose KV is final.

A block is registered only when every token in it is computed and accepted (never a draft), and its KV
final in every layer the block tables address. With an MTP module (speculative decoding) that includes
the MTP layer, whose input at position p is the hidden state h_p fused with the embedding of token p + 1
(afd.engine.speculative): its KV at a block's last position depends on the token after the block. So with
MTP the hash covers that lookahead token too (`lookahead=1`), and a block is registered only once the
MTP module has run over it: for a running request, at the next schedule (after the step's drafting); for
a request that finishes, only the blocks of the steps before its last (the last one drafts nothing).
Megatron-Core's prefix cache keeps the same MTP successor token per block
(https://docs.nvidia.com/megatron-core/developer-guide/nightly/apidocs/core/core.inference.contexts.prefix_cache_block_state.html).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the allocator imports this module; a request needs the sampler (torch)
    from afd.engine.request import Request


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """sha256 over the parent's hash and the block's token ids (vLLM's default since it stopped using
    Python's hash(): a prompt must not be able to collide with another user's)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class CachedBlocks:
    """Hash <-> block maps and, per pool, the evictable blocks (cached, held by no request) oldest first."""

    def __init__(self, pools: int):
        self.pools = pools
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.evictable: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(pools)]

    def register(self, block: int, h: bytes) -> bool:
        """Names `block` by `h`; False when another block already holds that content (this one stays private)."""
        if h in self.by_hash or block in self.hash_of:
            return False
        self.by_hash[h], self.hash_of[block] = block, h
        return True

    def park(self, block: int) -> bool:
        """The last holder let go: a cached block becomes evictable (most recently used); False if uncached."""
        if block not in self.hash_of:
            return False
        self.evictable[block % self.pools][block] = None
        return True

    def unpark(self, block: int) -> None:
        """A request takes a cached block nobody held: it is no longer evictable."""
        self.evictable[block % self.pools].pop(block, None)

    def evict(self, pool: int) -> int | None:
        """The pool's least recently used evictable block, forgotten; None when there is none."""
        if not self.evictable[pool]:
            return None
        block, _ = self.evictable[pool].popitem(last=False)
        del self.by_hash[self.hash_of.pop(block)]
        return block


@dataclass
class _Seq:
    hashes: list[bytes] = field(default_factory=list)
    """The hashes of the request's first blocks, extended as its tokens become known."""
    registered: int = 0
    """Its first `registered` blocks are in the cache (registered, or hit)."""
    final: int = 0
    """With MTP: tokens whose MTP-layer KV is written too (num_computed at the last schedule)."""


class PrefixCache:
    """The scheduler's side: hashes per request, lookups and registrations, and vLLM's two counters
    (prefix_cache_queries / _hits, in tokens: a request's tokens when admitted, and those found cached)."""

    def __init__(self, blocks: CachedBlocks, block_size: int, lookahead: int = 0):
        self.blocks, self.block_size, self.lookahead = blocks, block_size, lookahead
        self.queries = self.hits = 0
        self._seqs: dict[int, _Seq] = {}  # by id(request): Request is a dataclass, so unhashable

    def _seq(self, req: Request) -> _Seq:
        return self._seqs.setdefault(id(req), _Seq())

    def _hashes(self, req: Request, seq: _Seq, n: int) -> list[bytes]:
        """The request's first n block hashes (their tokens, and the lookahead, must be known)."""
        if len(seq.hashes) < n:
            ids, B = req.all_ids, self.block_size
            for k in range(len(seq.hashes), n):
                parent = seq.hashes[-1] if seq.hashes else b""
                seq.hashes.append(block_hash(parent, ids[k * B : (k + 1) * B + self.lookahead]))
        return seq.hashes[:n]

    def lookup(self, req: Request) -> list[int]:
        """The cached blocks a request admitted with nothing computed starts from: the longest run of its
        first blocks, leaving at least its last token to compute (the step needs that token's logits)."""
        seq = self._seq(req)
        limit = (req.num_tokens - 1) // self.block_size  # with lookahead, the token after stays known
        hit: list[int] = []
        for k, h in enumerate(self._hashes(req, seq, max(0, limit))):
            block = self.blocks.by_hash.get(h)
            if block is None:
                break
            assert block % self.blocks.pools == k % self.blocks.pools  # KVP: the i-th block from pool i % N
            hit.append(block)
        return hit

    def admitted(self, req: Request, hit: list[int]) -> None:
        """The request runs from its `hit` blocks (counted as vLLM counts them). Its MTP-layer KV is final
        only within them until its next schedule (a preempted request recomputes the rest)."""
        seq = self._seq(req)
        seq.registered, seq.final = len(hit), len(hit) * self.block_size
        self.queries += req.num_tokens
        self.hits += len(hit) * self.block_size

    def scheduled(self, req: Request) -> None:
        """Before a running request's next step: every token it has computed has its KV final, the MTP
        layer's included (the last step's drafting ran)."""
        seq = self._seq(req)
        seq.final = req.num_computed
        self.register(req, req.num_computed)

    def register(self, req: Request, computed: int) -> None:
        """Registers the request's full blocks among its first `computed` tokens whose KV is final."""
        seq = self._seq(req)
        limit = min(computed, seq.final) if self.lookahead else computed
        limit = min(limit, req.num_tokens - self.lookahead, len(req.block_table) * self.block_size)
        n = max(0, limit) // self.block_size
        if n <= seq.registered:
            return
        for k, h in enumerate(self._hashes(req, seq, n)[seq.registered :], seq.registered):
            self.blocks.register(req.block_table[k], h)
        seq.registered = n

    def forget(self, req: Request) -> None:
        self._seqs.pop(id(req), None)
