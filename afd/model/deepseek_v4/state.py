"""DeepSeek-V4's per-sequence attention state, kept in the engine's paged KV cache (afd.engine.kv_cache).

Each layer's state is a set of per-token *planes* side by side in one paged tensor [blocks, block_size, W],
addressed by the sequence's block table like any family's KV: the token at position p owns slot p.

  kv          [D]      the shared K=V head (normed, rotated): the sliding window reads the last
                       `sliding_window` of these
  ckv, cgate  [o*D]    the compressor's projections of the token (CSA: o = 2 overlapping series, HCA: o = 1);
                       a window's entry is made from them once its last token is in
  entry       [D]      compressed entry w (tokens [w*r, (w+1)*r)), held in the slot of the window's last
                       token (w+1)*r - 1: every r-th slot of this plane is used
  ikv, igate  [2*c]    (CSA only) the lightning indexer's own compressor projections, c = index_head_dim
  ientry      [c]      (CSA only) the indexer's compressed key w, in the same slot as `entry`

This is the full-history form: every position keeps its planes, so memory per token is W values per layer
rather than what V4 needs at steady state (a window ring, 1/r of an entry, and the open window's
projections). It is correct under chunked prefill, preemption (recompute) and prefix caching, since every
value in slot p depends only on tokens <= p, and it needs no allocator of its own. Rings and compact
compressed blocks are the next step (issue 31).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from afd.model.deepseek_v4.config import DeepseekV4Config


@dataclass(frozen=True)
class Planes:
    """Column offsets of one layer's planes in its [.., W] state (absent planes: empty ranges)."""

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
    def entry(self) -> slice:
        return self._after(self.cgate, self.head_dim if self.rate else 0)

    @property
    def ikv(self) -> slice:
        return self._after(self.entry, 2 * self.index_dim)

    @property
    def igate(self) -> slice:
        return self._after(self.ikv, 2 * self.index_dim)

    @property
    def ientry(self) -> slice:
        return self._after(self.igate, self.index_dim)

    @property
    def width(self) -> int:
        return self.ientry.stop


def layer_planes(cfg: DeepseekV4Config, i: int) -> Planes:
    from afd.model.deepseek_v4.config import CSA

    rate = cfg.compress_rate(i)
    csa = cfg.layer_types[i] == CSA
    overlap = 0 if not rate else (2 if csa else 1)
    return Planes(cfg.head_dim, rate, overlap, cfg.index_head_dim if csa else 0)
