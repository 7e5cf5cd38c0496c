"""The kinds of per-sequence state a family keeps, as the engine's paged cache (afd.engine.kv_cache) holds them.

A family declares a tuple of `StateKind`s (its config's `state_kinds`). The first is the sequence's *primary*
kind: one slot per token, addressed by the block table the engine already keeps (block j: tokens [j * bs,
(j + 1) * bs)). The others are compressed: a slot per `rate` tokens, with a block table of their own. A kind is
full history (`lookback` None) or a window: a new token at position p reads that kind only at positions
>= p - lookback, so the blocks wholly before that are given back as the sequence advances.

The existing families declare one full-history per-token kind, laid out as before by `kv_cache_shape`
([layers, blocks, block_size, ...]). A family with more kinds (DeepSeek-V4) gets one page pool: every page is
`page_values` values, a kind's page holds `slots` of its rows (each row: every layer's columns of that kind,
so no layer is padded to the widest), and one allocator hands pages to every kind. This is vLLM v1's
KVCacheGroup / SlidingWindowManager design (vllm-project/vllm: vllm/v1/core/single_type_kv_cache_manager.py,
vllm/v1/kv_cache_interface.py: one block pool, equal page sizes, out-of-window blocks freed), with afd's
shapes; the pages are made equal by giving each kind as many slots as fit, not by changing the block size.

The state rule (afd.engine.kv_cache) holds per kind: a slot for token (or compressed) position p depends only
on tokens <= p (a compressed slot w: on tokens < (w + 1) * rate)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

NULL_BLOCK = -1
"""A window kind's block table entry for a block given back: positions no new token reads."""


@dataclass(frozen=True)
class StateKind:
    """One kind of state: per layer, `widths[i]` values per slot (0: layer i keeps none of it)."""

    name: str
    widths: tuple[int, ...]
    rate: int = 1
    """Tokens per slot: 1 per token, r for compressed entries (slot w made from tokens [w*r, (w+1)*r))."""
    lookback: int | None = None
    """None: full history; else the positions before a new token it may read."""

    @property
    def width(self) -> int:
        """Values per slot, all layers."""
        return sum(self.widths)

    def columns(self, i: int) -> slice:
        """Layer i's columns in a slot's row."""
        start = sum(self.widths[:i])
        return slice(start, start + self.widths[i])

    def slots_for(self, num_tokens: int) -> int:
        """Slots a sequence of num_tokens computed tokens has: complete windows only for compressed kinds."""
        return num_tokens // self.rate


@dataclass(frozen=True)
class StateLayout:
    """A family's kinds at a block size: how many slots of each a page holds."""

    kinds: tuple[StateKind, ...]
    block_size: int

    def __post_init__(self):
        k0 = self.kinds[0]
        if k0.rate != 1:
            raise ValueError(f"the primary state kind {k0.name!r} must have a slot per token")
        if any(k.lookback is not None for k in self.kinds[1:]):
            raise ValueError("only the primary state kind may be a window (KVCache.release_window frees its pages)")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.kinds)

    @property
    def paged_pool(self) -> bool:
        """Several kinds, or a window: pages of the shared pool, not kv_cache_shape's layout."""
        return len(self.kinds) > 1 or self.kinds[0].lookback is not None

    @property
    def page_values(self) -> int:
        """Values per page: block_size slots of the primary kind (at least one slot of every kind)."""
        return max(self.block_size * self.kinds[0].width, *(k.width for k in self.kinds))

    def slots(self, k: int) -> int:
        """Slots of kind k in a page (the primary kind: block_size, as its block table reads)."""
        return self.block_size if k == 0 else self.page_values // self.kinds[k].width

    def blocks_for(self, k: int, num_tokens: int) -> int:
        """Pages kind k holds for a sequence of num_tokens tokens (a window's given-back ones included)."""
        return -(-self.kinds[k].slots_for(num_tokens) // self.slots(k)) if k else -(-num_tokens // self.block_size)

    def first_needed(self, num_tokens: int) -> int:
        """The primary kind's first block a sequence with num_tokens computed still reads (0: full history)."""
        lb = self.kinds[0].lookback
        return 0 if lb is None else max(0, num_tokens - lb) // self.block_size

    def peak_pages(self, num_tokens: int, chunk: int) -> int:
        """The most pages one sequence of num_tokens tokens holds at once, computed chunk tokens a step: a
        window's pages are given back before each step, so at most its lookback and one chunk (and a block
        each side for alignment) are held; every compressed kind keeps its whole history."""
        lb = self.kinds[0].lookback
        held = num_tokens if lb is None else min(num_tokens, lb + chunk + 2 * self.block_size)
        return -(-held // self.block_size) + sum(self.blocks_for(k, num_tokens) for k in range(1, len(self.kinds)))

    def pool_pages(self, token_blocks: int) -> int:
        """Pages for `token_blocks` blocks of tokens in full: the primary kind's, each compressed kind's share,
        and its partly filled last page of up to token_blocks / 8 + 1 sequences."""
        pages = token_blocks
        for i, k in enumerate(self.kinds[1:], 1):
            pages += -(-token_blocks * self.block_size // (k.rate * self.slots(i))) + token_blocks // 8 + 1
        return pages


def values_per_token(kinds: tuple[StateKind, ...]) -> float:
    """Values a token adds to the full-history kinds, amortised (compressed slots: width / rate)."""
    return sum(k.width / k.rate for k in kinds if k.lookback is None)


def values_per_sequence(kinds: tuple[StateKind, ...]) -> int:
    """Values a sequence holds at most in its windows, however long (lookback + 1 positions of each)."""
    return sum((k.lookback + 1) * k.width // k.rate for k in kinds if k.lookback is not None)


class BlockTable(list):
    """A sequence's block table (the primary kind's page ids, one per block_size tokens) and, in `kinds`, each
    compressed kind's. A list, so that every path that carries a block table carries the others with it."""

    kinds: dict[str, list[int]]

    def __init__(self, *args, kinds: dict[str, list[int]] | None = None):
        super().__init__(*args)
        self.kinds = kinds if kinds is not None else {}


def kind_table(table: BlockTable, name: str) -> list[int]:
    """The block table of kind `name` of a sequence whose primary table is `table`."""
    return table.kinds[name]  # KeyError / AttributeError: not a table of KVCache.new_table()


@dataclass
class PagedLayer:
    """Layer i's state in a page pool (what KVCache.layer gives a family with several kinds)."""

    pool: torch.Tensor = field(repr=False)  # [pages, page_values]
    layout: StateLayout
    layer: int

    def view(self, name: str) -> torch.Tensor:
        """[pages, slots, width]: this layer's columns of kind `name`, a view writes go through."""
        k = next(j for j, kind in enumerate(self.layout.kinds) if kind.name == name)
        kind, slots = self.layout.kinds[k], self.layout.slots(k)
        rows = self.pool[:, : slots * kind.width].view(self.pool.shape[0], slots, kind.width)
        return rows[:, :, kind.columns(self.layer)]


def full_history(cfg) -> tuple[StateKind, ...]:
    """The one kind of a family that keeps every token's state in kv_cache_shape's layout (MLA latents, K/V
    heads): values per token and layer from kv_cache_shape(1, 1) = [layers, ...]."""
    shape = cfg.kv_cache_shape(1, 1)
    per_layer = 1
    for d in shape[1:]:
        per_layer *= d
    return (StateKind("kv", (per_layer,) * shape[0]),)


def state_bytes_per_token(cfg, dtype_bytes: int) -> float:
    """Bytes a token adds to a family's state at steady state (any family: cfg.state_kinds()); a compressed
    kind's amortised over its rate, a window's not at all (window_bytes_per_sequence)."""
    return values_per_token(cfg.state_kinds()) * dtype_bytes


def window_bytes_per_sequence(cfg, dtype_bytes: int) -> int:
    """Bytes a sequence holds in its windows however long it is (lookback + 1 positions; its pages round this
    up to whole blocks); 0 for a family that keeps full history only."""
    return values_per_sequence(cfg.state_kinds()) * dtype_bytes
