"""DeepSeek-V4's per-sequence attention state, kept in the engine's paged KV cache (afd.engine.kv_cache).

Each layer's row of the cache is, per block, a flat run of E values that this module carves into two paged
planes, both addressed by the sequence's block table (so the engine's one allocator takes, preempts, frees
and shares them like any family's KV):

  tokens   [block_size, Wt] per block, one slot per token position p (block table[p // bs], offset p % bs):
      kv          [D]    the shared K=V head (normed, rotated): the sliding window reads the last
                         `sliding_window` of these
      ckv, cgate  [o*D]  the compressor's projections (CSA: o = 2 overlapping series, HCA: o = 1), from which a
                         window's entry is made once its last token is in
      ikv, igate  [2*c]  (CSA) the lightning indexer's compressor projections, c = index_head_dim
  entries  [ceil(block_size / r), We] per block, one slot per *compressed* position w, in the block of its
           window's last token e = (w + 1) * r - 1, at offset (e % bs) // r:
      entry       [D]    compressed entry w (tokens [w*r, (w+1)*r))
      ientry      [c]    (CSA) the indexer's compressed key w

Every value in a block depends only on the tokens at or before the positions the block covers, which is what
preemption (recompute) and prefix caching need. What is not compact yet: the token planes keep every
position's kv and projections (full history) where V4 needs a window ring and the open windows' projections
only; those need per-sequence state beside the block table (issue 31's next step). A layer's E is its own;
the cache row is as wide as the widest layer's (kv_cache_shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from afd.model.deepseek_v4.config import DeepseekV4Config


@dataclass(frozen=True)
class Planes:
    """Column ranges of one layer's token and entry planes, and how a block holds them."""

    head_dim: int
    rate: int
    overlap: int  # 2 for CSA, 1 for HCA, 0 for a sliding-window-only layer
    index_dim: int  # 0 without an indexer

    @property
    def kv(self) -> slice:
        return slice(0, self.head_dim)

    def _after(self, s: slice, n: int) -> slice:
        return slice(s.stop, s.stop + n)

    @property
    def ckv(self) -> slice:
        return self._after(self.kv, self.overlap * self.head_dim)

    @property
    def cgate(self) -> slice:
        return self._after(self.ckv, self.overlap * self.head_dim)

    @property
    def ikv(self) -> slice:
        return self._after(self.cgate, 2 * self.index_dim)

    @property
    def igate(self) -> slice:
        return self._after(self.ikv, 2 * self.index_dim)

    @property
    def token_width(self) -> int:
        return self.igate.stop

    @property
    def entry(self) -> slice:
        return slice(0, self.head_dim if self.rate else 0)

    @property
    def ientry(self) -> slice:
        return self._after(self.entry, self.index_dim)

    @property
    def entry_width(self) -> int:
        return self.ientry.stop

    def entry_slots(self, block_size: int) -> int:
        """Compressed positions a block can hold: the window ends among its block_size positions."""
        return -(-block_size // self.rate) if self.rate else 0

    def block_values(self, block_size: int) -> int:
        """E: values per block of this layer."""
        return block_size * self.token_width + self.entry_slots(block_size) * self.entry_width

    def views(self, kv: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's cache row kv [blocks, E_max] as (tokens [blocks, block_size, Wt], entries [blocks, slots,
        We]): views (never copies) that writes go through."""
        blocks, n_tok = kv.shape[0], block_size * self.token_width
        slots = self.entry_slots(block_size)
        tokens = kv[:, :n_tok].view(blocks, block_size, self.token_width)
        entries = kv[:, n_tok : n_tok + slots * self.entry_width].view(blocks, slots, self.entry_width)
        return tokens, entries

    def entry_at(self, table: torch.Tensor, block_size: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, slot) in `entries` of a sequence's compressed positions w (table: its block ids)."""
        end = (w + 1) * self.rate - 1
        return table[end // block_size], (end % block_size) // self.rate


def layer_planes(cfg: DeepseekV4Config, i: int) -> Planes:
    from afd.model.deepseek_v4.config import CSA

    rate = cfg.compress_rate(i)
    csa = cfg.layer_types[i] == CSA
    overlap = 0 if not rate else (2 if csa else 1)
    return Planes(cfg.head_dim, rate, overlap, cfg.index_head_dim if csa else 0)
