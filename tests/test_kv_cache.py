"""The paged KV cache: allocator bookkeeping, and generation independent of the block size."""

from __future__ import annotations

import pytest
import torch
from hf_reference import PROMPTS

import afd
from afd.engine.kv_cache import BlockAllocator, KVCache, OutOfBlocks, blocks_needed
from afd.model.attention_metadata import AttentionMetadata


def test_allocator_hands_out_and_takes_back():
    a = BlockAllocator(4)
    first = a.allocate(3)
    assert sorted(first) == [0, 1, 2] and a.num_free == 1
    with pytest.raises(OutOfBlocks, match="need 2 KV blocks, 1 free of 4"):
        a.allocate(2)
    a.free(first)
    assert a.num_free == 4 and len(set(a.allocate(4))) == 4


def test_blocks_needed():
    assert [blocks_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_slot_mapping_follows_block_table():
    meta = AttentionMetadata.build(
        starts=[0, 5], lens=[3, 1], block_tables=[[7], [2, 9]], block_size=4, device=torch.device("cpu")
    )
    assert meta.positions.tolist() == [0, 1, 2, 5]
    assert meta.slot_mapping.tolist() == [28, 29, 30, 9 * 4 + 1]
    assert meta.decode_rows.tolist() == [3] and meta.decode_ctx_lens.tolist() == [6]
    assert [s.q_len for s in meta.prefill_seqs] == [3]


def test_grow_extends_table(tiny_checkpoint):
    cfg = afd.LLM(tiny_checkpoint).cfg
    kv = KVCache(cfg, num_blocks=8, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    table: list[int] = []
    kv.grow(table, 9)
    assert len(table) == 3 and kv.usage() == pytest.approx(3 / 8)
    kv.grow(table, 12)
    assert len(table) == 3


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_tokens_do_not_depend_on_block_size(tiny_checkpoint, block_size):
    # The longest prompt spans many blocks at sizes 1 and 3; 16 keeps short prompts inside one block.
    ref = afd.LLM(tiny_checkpoint, block_size=64).generate_ids(PROMPTS, 20)
    assert afd.LLM(tiny_checkpoint, block_size=block_size).generate_ids(PROMPTS, 20) == ref


def test_sequences_ending_at_different_steps(tiny_checkpoint):
    llm = afd.LLM(tiny_checkpoint, block_size=4)
    full = llm.generate_ids(PROMPTS, 20, ignore_eos=True)
    lens = [3, 20, 1, 9]
    short = llm.generate_ids(PROMPTS, lens, ignore_eos=True)
    assert [len(s) for s in short] == lens
    assert all(s == f[: len(s)] for s, f in zip(short, full))
