"""Grouped-query attention over a paged cache of K and V heads (Llama / Qwen style).

Per token the cache keeps the rotated key heads and the value heads: cache [2, num_blocks, block_size, KVH, D],
K at [0] and V at [1]. Query head h reads key/value head h // G (G = NH / KVH), as HF's repeat_kv lays
them out, so the queries are viewed [.., KVH, G, D] and never copied per group.

Decode reads the cache in place, a chunk of blocks at a time (afd/model/paged_attention.py says why).
Optional per-head RMSNorm of q and k before RoPE (Qwen3's q_norm / k_norm). RoPE rotates halves
(x_j, x_{j + D/2}), HF's rotate_half layout.
Shapes: T tokens, H hidden, NH query heads, KVH key/value heads, G = NH / KVH, D head dim, L context.
"""

from __future__ import annotations

import torch
from torch import nn

from afd.model import paged_attention
from afd.model.attention_metadata import AttentionMetadata, store_kv
from afd.model.layers import RMSNorm, apply_rotary_halves


class GQAttention(nn.Module):
    def __init__(
        self,
        hidden: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        bias: bool = False,
        qk_norm_eps: float | None = None,
    ):
        """qk_norm_eps: RMSNorm each q and k head with this eps (None: no q/k norm)."""
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=bias)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.qk_norm = qk_norm_eps is not None
        self.scale = head_dim**-0.5

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, cache: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H]; cache [2, num_blocks, block_size, KVH, D] for this layer. Returns [T, H]."""
        T, D = x.shape[0], self.head_dim
        q = self.q_proj(x).view(T, self.n_heads, D)
        k = self.k_proj(x).view(T, self.n_kv, D)
        v = self.v_proj(x).view(T, self.n_kv, D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_halves(q, cos, sin), apply_rotary_halves(k, cos, sin)
        store_kv(cache[0], meta.slot_mapping, k)
        store_kv(cache[1], meta.slot_mapping, v)

        q = q.view(T, self.n_kv, -1, D)  # [T, KVH, G, D]
        out = torch.empty_like(q)
        if meta.decode_rows.numel():
            dec = meta.decode_rows
            out[dec] = self._decode(q[dec], meta, cache)
        for s in meta.prefill_seqs:
            rows = slice(s.q_start, s.q_start + s.q_len)
            out[rows] = self._prefill(q[rows], s.ctx_len, s.block_table, cache)
        return self.o_proj(out.view(T, -1))

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata, cache: torch.Tensor) -> torch.Tensor:
        """One query per sequence. q [B, KVH, G, D] -> [B, KVH, G, D]."""

        def read(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return paged_attention.gather(cache[0], blocks), paged_attention.gather(cache[1], blocks)  # [B, l, KVH, D]

        eqs = ("bkgd,blkd->bkgl", "bkgl,blkd->bkgd")
        tables, ctx_lens = meta.decode_block_tables, meta.decode_ctx_lens
        return paged_attention.attend(q, tables, ctx_lens, meta.block_size, read, eqs, self.scale)[0]

    def _prefill(self, q: torch.Tensor, ctx_len: int, table: list[int], cache: torch.Tensor) -> torch.Tensor:
        """n queries at positions [ctx_len - n, ctx_len). q [n, KVH, G, D] -> [n, KVH, G, D]."""
        n, bs = q.shape[0], cache.shape[2]
        blocks = torch.tensor(table[: (ctx_len + bs - 1) // bs], dtype=torch.long, device=cache.device)
        k = cache[0][blocks].view(-1, self.n_kv, self.head_dim)[:ctx_len]  # [L, KVH, D]
        v = cache[1][blocks].view(-1, self.n_kv, self.head_dim)[:ctx_len]
        score = torch.einsum("nkgd,lkd->kgnl", q, k) * self.scale
        q_pos = torch.arange(ctx_len - n, ctx_len, device=k.device)
        k_pos = torch.arange(ctx_len, device=k.device)
        score.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        p = torch.softmax(score, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum("kgnl,lkd->nkgd", p, v)
