"""Decode attention that reads the paged KV cache in place, a bounded chunk of blocks at a time.

Why not gather each sequence's whole cache (cache[block_table]) and run one softmax: that copy is made
on every layer of every decode step, B x L x (cache row) values written and then read again by the score
and value products, so at long contexts it costs as much as the attention itself and its buffer grows
with L. Here each step reads `chunk` blocks per sequence (a copy small enough to still be in the CPU's
caches when the two products read it) and merges the chunks' partial softmaxes online (flash-decoding):

    m' = max(m, max_j s_j)     d' = d e^(m - m') + sum_j e^(s_j - m')     o' = o e^(m - m') + sum_j e^(s_j - m') v_j

which after the last chunk is exactly softmax attention over all of them (o / d; lse = m + log d for
the KVP merge). A table that fits in one chunk takes the plain softmax in HF eager's dtypes instead, so
short contexts round as HF does (tests/test_bf16_parity.py holds Qwen3's bf16 decode to it bit for bit).
Peak memory is one chunk's keys, values and scores: B x chunk x bs rows, whatever L.

Shapes: B sequences, nb blocks in the (padded) block tables, bs block size, l = chunk x bs keys per
chunk, S the query's head dims ([NH] for MLA, [KVH, G] for GQA), Dv the value width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CHUNK_BLOCKS = 64
"""Blocks per chunk (1,024 keys at block size 16), by measurement on CPU (docs/benchmarks/paged-attention.md):
contexts up to 1,024 tokens run as one chunk and pay nothing for the merge; smaller chunks pay a dozen
small ops each (4 blocks: 2.4x the attention time at 4,096 tokens), 256 was no faster, and the chunk is
the memory bound, so the smallest of the fast sizes."""


def gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, bs, ...], blocks [B, j] -> the chunk's rows [B, j * bs, ...] (a bounded copy)."""
    B, j = blocks.shape
    return cache.index_select(0, blocks.flatten()).view(B, j * cache.shape[1], *cache.shape[2:])


def attend(
    q: torch.Tensor,
    tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    block_size: int,
    read: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    equations: tuple[str, str],
    scale: float,
    positions: torch.Tensor | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per sequence over its paged keys. q [B, *S, Dk]; tables [B, nb] block ids; ctx_lens [B]:
    key positions >= ctx_len are not visible; read(blocks [B, j]) -> (keys, values) of those blocks in the
    layout `equations` = (score, output) einsum strings expect; positions [B or 1, nb * bs]: the absolute
    position of each slot (KVP's local blocks; None: slot index = position).

    Returns (o [B, *S, Dv] in q's dtype, lse [B, *S] fp32). A row that sees no key (a KV rank holding
    none of the sequence) gets o = 0 and lse = -inf, as kvp.merge expects."""
    B, nb = tables.shape
    chunk = chunk or CHUNK_BLOCKS  # read here: the benchmark times other sizes
    if nb == 0:  # a KV rank holding none of these sequences' blocks
        _, values = read(tables)
        o0 = torch.einsum(equations[1], q.new_zeros(*q.shape[:-1], 0), values)  # zeros [B, *S, Dv]
        return o0, torch.full(o0.shape[:-1], float("-inf"), device=o0.device)
    extra = (1,) * (q.dim() - 1)  # broadcasts [B, l] masks over the head dims S
    ctx = ctx_lens.view(B, *extra)

    def scores(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks [lo, hi) of the tables: (scores [B, *S, l] in q's dtype, -inf where not visible; values)."""
        keys, values = read(tables[:, lo:hi])
        s = torch.einsum(equations[0], q, keys) * scale  # rounded as HF's eager attention rounds it
        if positions is None:
            pos = torch.arange(lo * block_size, hi * block_size, device=s.device).view(1, *extra[:-1], -1)
        else:
            pos = positions[:, lo * block_size : hi * block_size].reshape(-1, *extra[:-1], s.shape[-1])
        return s.masked_fill_(pos >= ctx, float("-inf")), values

    if nb <= chunk:  # one chunk: the plain softmax, in HF eager's dtypes (bf16 decode stays bit-equal to it)
        s, values = scores(0, nb)
        p = torch.softmax(s, dim=-1, dtype=torch.float32).nan_to_num(0.0)  # no visible key: a row of nan -> 0
        return torch.einsum(equations[1], p.to(values.dtype), values).to(q.dtype), torch.logsumexp(s.float(), -1)
    acc: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (m, d, o) of the chunks so far
    for lo in range(0, nb, chunk):
        s_c, values = scores(lo, min(nb, lo + chunk))
        s = s_c.float()
        m_c = s.amax(dim=-1)  # [B, *S]
        m_new = m_c if acc is None else torch.maximum(acc[0], m_c)
        base = m_new.masked_fill(m_new == float("-inf"), 0.0)  # no visible key yet: e^(-inf - 0) = 0, not nan
        p = torch.exp(s - base.unsqueeze(-1))
        o_c = torch.einsum(equations[1], p.to(values.dtype), values).float()  # [B, *S, Dv]
        if acc is None:
            acc = (m_new, p.sum(dim=-1), o_c)
        else:
            m, d, o = acc
            alpha = torch.exp(m - base)  # rescales what the earlier chunks summed to the new max
            acc = (m_new, d * alpha + p.sum(dim=-1), o * alpha.unsqueeze(-1) + o_c)
    assert acc is not None  # nb > 0: the loop ran
    m, d, o = acc
    lse = m + torch.log(d)
    out = o / d.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    return out.to(q.dtype), lse
