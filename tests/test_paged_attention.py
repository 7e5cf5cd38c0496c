"""Decode attention reads the paged cache a chunk of blocks at a time (afd/model/paged_attention.py): the
chunks' online-softmax merge is softmax attention, every family still decodes HF's tokens when every
block is a chunk of its own, and no decode builds a copy of a whole sequence's cache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import REF_TOKENS
from hf_families import FAMILIES
from hf_reference import PROMPTS
from test_families import _assert_matches_hf
from torch.utils._python_dispatch import TorchDispatchMode

import afd
from afd.model import paged_attention
from afd.model.attention_metadata import AttentionMetadata
from afd.model.gqa import GQAttention
from afd.model.mla import MLAttention

EQS = ("bhd,bld->bhl", "bhl,blc->bhc")  # MLA's shapes: S = [NH]


def _softmax_reference(q, keys, ctx_pos, ctx_lens, scale):
    """Plain softmax over every key at once. keys [B, L, D]; ctx_pos [B or 1, L]."""
    s = torch.einsum(EQS[0], q, keys) * scale
    s.masked_fill_(ctx_pos[:, None, :] >= ctx_lens[:, None, None], float("-inf"))
    return torch.softmax(s, dim=-1) @ keys, torch.logsumexp(s, dim=-1)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunks_merge_to_one_softmax(chunk):
    torch.manual_seed(0)
    B, NH, D, bs, nb = 4, 3, 8, 4, 10
    cache = torch.randn(64, bs, D)
    tables = torch.randint(0, 64, (B, nb))
    ctx = torch.tensor([1, 5, 23, 40])  # one key, a partial block, a chunk boundary, every slot
    q = torch.randn(B, NH, D)

    def read(blocks):
        kv = paged_attention.gather(cache, blocks)
        return kv, kv

    o, lse = paged_attention.attend(q, tables, ctx, bs, read, EQS, 0.3, chunk=chunk)
    ref_o, ref_lse = _softmax_reference(q, cache[tables].view(B, -1, D), torch.arange(nb * bs)[None], ctx, 0.3)
    # fp32 either way, summed in another order (chunk by chunk, rescaled): ~1e-7 apart
    torch.testing.assert_close(o, ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_a_row_that_sees_no_key_gets_zero_and_minus_infinity():
    """KVP: a rank may hold none of a sequence's visible keys (or no block of it at all)."""
    cache = torch.randn(8, 2, 4)
    q, ctx = torch.randn(2, 1, 4), torch.tensor([3, 9])
    pos = (torch.arange(8) + 4)[None]  # the local slots hold positions 4..11: row 0 sees none

    def read(blocks):
        kv = paged_attention.gather(cache, blocks)
        return kv, kv

    o, lse = paged_attention.attend(q, torch.tensor([[1, 2, 3, 4]] * 2), ctx, 2, read, EQS, 1.0, pos, chunk=1)
    assert o[0].abs().max() == 0 and lse[0].item() == float("-inf") and torch.isfinite(lse[1]).all()
    o, lse = paged_attention.attend(q, torch.zeros(2, 0, dtype=torch.long), ctx, 2, read, EQS, 1.0, pos)
    assert o.shape == (2, 1, 4) and not o.any() and (lse == float("-inf")).all()


@pytest.mark.parametrize("family", ["longcat_flash", "deepseek_v3", "qwen3_moe"])
def test_one_block_per_chunk_decodes_hfs_tokens(families, family, monkeypatch):
    """Block size 4 and a chunk of one block: every decode step merges several chunks (the product's
    chunks hold 64 blocks, more than these prompts fill)."""
    monkeypatch.setattr(paged_attention, "CHUNK_BLOCKS", 1)
    name = next(iter(FAMILIES[family].configs))
    logits: list = []
    llm = afd.LLM(families.path(family, name), dtype="float32", block_size=4)
    ids = llm.generate_ids(PROMPTS, REF_TOKENS, logits_out=logits)
    _assert_matches_hf(family, ids, logits, families.ref(family, name))  # its tolerance: test_families.py's


class _Largest(TorchDispatchMode):
    """The largest tensor any op makes, other than views of (or writes into) the KV cache."""

    def __init__(self, cache: torch.Tensor):
        super().__init__()
        self.cache_ptr, self.largest = cache.untyped_storage().data_ptr(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() != self.cache_ptr:
                self.largest = max(self.largest, t.numel())
        return out


def _decode_meta(B: int, ctx: int, bs: int) -> AttentionMetadata:
    nb = ctx // bs
    tables = [list(range(i, B * nb, B)) for i in range(B)]  # interleaved, as a busy pool hands them out
    return AttentionMetadata.build([ctx - 1] * B, [1] * B, tables, bs, torch.device("cpu"))


@pytest.mark.parametrize("kind", ["mla", "gqa"])
def test_decode_never_copies_a_whole_sequence(kind):
    """At 4,096 tokens of context no temporary is larger than one chunk of blocks: a return of the
    whole-sequence gather (cache[block_tables]) would make one 4x larger."""
    torch.manual_seed(0)
    B, ctx, bs = 2, 4096, 16
    meta = _decode_meta(B, ctx, bs)
    if kind == "mla":
        cfg = SimpleNamespace(
            num_attention_heads=2, hidden_size=32, qk_nope_head_dim=8, qk_rope_head_dim=4, qk_head_dim=12,
            v_head_dim=8, q_lora_rank=16, kv_lora_rank=16, attention_bias=False,
        )  # fmt: skip
        attn: torch.nn.Module = MLAttention(cfg)
        cache = torch.randn(B * ctx // bs, bs, 16 + 4)
        cos, sin = torch.ones(B, 2), torch.zeros(B, 2)
    else:
        attn = GQAttention(32, n_heads=4, n_kv_heads=2, head_dim=8, qk_norm_eps=1e-6)
        cache = torch.randn(2, B * ctx // bs, bs, 2, 8)
        cos, sin = torch.ones(B, 4), torch.zeros(B, 4)
    row = cache[0, 0, 0].numel() if kind == "gqa" else cache.shape[-1]  # one token's cache values per K / V / latent
    with torch.no_grad(), _Largest(cache) as seen:
        out = attn(torch.randn(B, 32), cos, sin, meta, cache)
    assert out.shape == (B, 32) and torch.isfinite(out).all()
    chunk_rows = B * paged_attention.CHUNK_BLOCKS * bs * row
    assert chunk_rows * 4 <= B * ctx * row  # the bound below tells a chunk from a whole sequence
    assert seen.largest <= chunk_rows, f"a temporary of {seen.largest} values: a whole-sequence copy is back"
