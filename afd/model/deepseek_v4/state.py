"""DeepSeek-V4's per-sequence attention state, as kinds of the engine's paged state (afd.model.state_spec).

  window   one slot per token, lookback = the most any layer reads back (sliding_window - 1 for the keys,
           2r - 1 for CSA's overlapping compressor windows, r - 1 for HCA's); per layer:
      kv          [D]    the shared K=V head (normed, rotated): the sliding window reads the last
                         `sliding_window` of these
      ckv, cgate  [o*D]  the compressor's projections (CSA: o = 2 overlapping series, HCA: o = 1), from which a
                         window's entry is made once its last token is in
      ikv, igate  [2*c]  (CSA) the lightning indexer's compressor projections, c = index_head_dim
  CSA, HCA  (kinds named by the layer type) one slot per compressed position w (tokens [w*r, (w+1)*r)), full
           history, each with its own block table; per layer of that type:
      entry       [D]    compressed entry w
      ientry      [c]    (CSA) the indexer's compressed key w

A layer's columns are its own (no padding to the widest layer); the window's blocks wholly before the lookback
go back to the allocator as the sequence advances, so a sequence holds a fixed window however long it gets,
and per token only its compressed entries (afd.model.state_spec.state_bytes_per_token,
window_bytes_per_sequence). Every slot
depends only on the tokens at or before the positions it covers: preemption recomputes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from afd.model.deepseek_v4.config import DeepseekV4Config
    from afd.model.state_spec import StateKind


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

    def block_values(self, block_size: int) -> int:
        """Values per block of a sliding-window-only layer's token plane held alone (an MTP block's own cache)."""
        if self.rate:
            raise ValueError("a compressed layer's state is kinds of the page pool, not one plane")
        return block_size * self.token_width

    def entry_at(self, table: torch.Tensor, slots: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, slot) in the entries view of a sequence's compressed positions w (table: its entry kind's
        pages, `slots` entries each)."""
        return table[w // slots], w % slots


def layer_planes(cfg: DeepseekV4Config, i: int) -> Planes:
    rate = cfg.compress_rate(i)
    csa = cfg.is_csa(i)
    overlap = 0 if not rate else (2 if csa else 1)
    return Planes(cfg.head_dim, rate, overlap, cfg.index_head_dim if csa else 0)


def entry_kind(cfg: DeepseekV4Config, i: int) -> str:
    """The name of the compressed kind holding layer i's entries ('' for a sliding-window-only layer)."""
    return cfg.layer_types[i] if cfg.compress_rate(i) else ""


def lookback(cfg: DeepseekV4Config) -> int:
    """Positions before a new token that some layer's window or open compressor window reads."""
    back = cfg.sliding_window - 1
    for i in range(len(cfg.layer_types)):
        r = cfg.compress_rate(i)
        if r:
            back = max(back, (2 * r if cfg.is_csa(i) else r) - 1)
    return back


def state_kinds(cfg: DeepseekV4Config) -> tuple[StateKind, ...]:
    """window (per token, a lookback), then one full-history compressed kind per compressed layer type."""
    from afd.model.state_spec import StateKind

    L = range(cfg.num_hidden_layers)
    kinds = [StateKind("window", tuple(layer_planes(cfg, i).token_width for i in L), 1, lookback(cfg))]
    for t in dict.fromkeys(entry_kind(cfg, i) for i in L):
        if t:
            rate = next(cfg.compress_rate(i) for i in L if cfg.layer_types[i] == t)
            widths = tuple(layer_planes(cfg, i).entry_width if cfg.layer_types[i] == t else 0 for i in L)
            kinds.append(StateKind(t, widths, rate))
    return tuple(kinds)
