"""Where each token of a flattened batch reads and writes the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd.backend.base import to_device


@dataclass
class SeqSlice:
    """One sequence's part of a step: its new tokens are rows [q_start, q_start + q_len) of the batch."""

    q_start: int
    q_len: int
    ctx_len: int
    """Tokens in the cache after this step's writes (cached prefix + the new tokens)."""
    block_table: list[int]


@dataclass
class AttentionMetadata:
    """Built once per step (per micro-batch) and shared by every attention layer."""

    positions: torch.Tensor  # [T] absolute position of each new token
    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset) each token writes
    seqs: list[SeqSlice]
    block_size: int
    # Batched single-token decode: rows, padded block tables and context lengths of those sequences.
    decode_rows: torch.Tensor  # [B] row of each decoding sequence in the batch
    decode_block_tables: torch.Tensor  # [B, max_blocks]
    decode_ctx_lens: torch.Tensor  # [B]
    prefill_seqs: list[SeqSlice]

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @classmethod
    def build(
        cls, starts: list[int], lens: list[int], block_tables: list[list[int]], block_size: int, device: torch.device
    ) -> AttentionMetadata:
        """starts[i]: tokens of sequence i already cached; lens[i]: its new tokens this step."""
        positions, slots, seqs = [], [], []
        q = 0
        for start, n, table in zip(starts, lens, block_tables):
            pos = list(range(start, start + n))
            positions += pos
            slots += [table[p // block_size] * block_size + p % block_size for p in pos]
            seqs.append(SeqSlice(q, n, start + n, table))
            q += n
        decode = [s for s in seqs if s.q_len == 1]
        max_blocks = max((len(s.block_table) for s in decode), default=0)
        tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in decode]

        def as_long(values: list) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=torch.long), device)

        return cls(
            positions=as_long(positions),
            slot_mapping=as_long(slots),
            seqs=seqs,
            block_size=block_size,
            decode_rows=as_long([s.q_start for s in decode]),
            decode_block_tables=as_long(tables).view(len(decode), max_blocks),
            decode_ctx_lens=as_long([s.ctx_len for s in decode]),
            prefill_seqs=[s for s in seqs if s.q_len > 1],
        )


@torch.library.custom_op("afd::store_kv", mutates_args=("cache",))
def _store_kv_op(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    cache.flatten(0, 1)[slots] = values


@_store_kv_op.register_fake
def _(cache, slots, values) -> None:
    return None


def store_kv(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """cache [num_blocks, block_size, ...] (a view into the KV cache), slots [T]: writes values [T, ...] to
    the flat slots. Under torch.compile (inductor) the write goes through one custom op that says it
    mutates `cache`: an indexed write into a view of a graph input is otherwise functionalized into a copy
    of the whole cache layer per call (measured: 60 ms instead of 0.06 ms for an 8192-block layer), while
    the op is put back in place. Eager, CUDA-graph capture and torchair (which lowers input mutations
    itself) take the plain indexed write."""
    if torch.compiler.is_compiling() and cache.device.type != "npu":
        _store_kv_op(cache, slots, values)
    else:
        cache.flatten(0, 1)[slots] = values
