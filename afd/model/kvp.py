"""KV-parallel attention (docs/design/longcat-on-ascend.md#kvp): N ranks of an attention node each hold
every N-th KV block.

Block g of the node's cache lives on KV rank g % N as local block g // N, and the i-th block of every
sequence comes from pool i % N (afd.engine.kv_cache.BlockAllocator), so each rank holds about 1/N of
every sequence and a node holds sequences N times longer than one rank could.

Attention runs on each rank over its own blocks only, for the heads of its head group, and returns with
each row its log-sum-exp; the ranks then swap heads (all_to_all) so that each holds all N partials of
its own heads, and merge them:

    o = sum_k exp(lse_k - LSE) * o_k,     LSE = logsumexp_k lse_k

which is exactly softmax attention over the union of the blocks. Decode (absorbed) and prefill (expanded)
both work this way, so a chunked prefill whose cached prefix is spread over the ranks needs nothing else
(the LongCat-Flash recipe prefills with heads split instead; this is the same sum, one path shorter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd.backend.base import to_device
from afd.model.attention_metadata import AttentionMetadata


@dataclass
class LocalView:
    """One micro-batch as KV rank k of N sees it (built once, shared by every layer)."""

    write_rows: torch.Tensor  # [W] rows of the batch whose KV this rank stores
    write_slots: torch.Tensor  # [W] their local slots
    decode_tables: torch.Tensor  # [B, nb] local block ids of each decoding sequence's blocks k, k+N, ...
    decode_pos: torch.Tensor  # [B, nb * block_size] the absolute position each local slot holds
    prefill: list[tuple[torch.Tensor, torch.Tensor]]  # per prefill sequence: (local blocks, their positions)


def local_view(meta: AttentionMetadata, n: int, k: int) -> LocalView:
    memo = meta.__dict__.setdefault("_kvp", {})
    if (n, k) not in memo:
        memo[(n, k)] = _build(meta, n, k)
    return memo[(n, k)]


def _build(meta: AttentionMetadata, n: int, k: int) -> LocalView:
    bs, dev = meta.block_size, meta.slot_mapping.device
    # the rows this rank writes, from the host's block tables: a mask's nonzero() would wait on the device
    rows, slots = [], []
    for s in meta.seqs:
        for j, at in enumerate(range(s.ctx_len - s.q_len, s.ctx_len)):
            b = s.block_table[at // bs]
            if b % n == k:
                rows.append(s.q_start + j)
                slots.append((b // n) * bs + at % bs)
    staged = to_device(torch.tensor([rows, slots], dtype=torch.long), dev)
    offs = torch.arange(bs, device=dev)
    tables = meta.decode_block_tables[:, k::n]  # [B, nb]: the sequence's blocks k, k + N, ...
    first = torch.arange(k, k + n * tables.shape[1], n, device=dev)  # their block index in the sequence
    pos = ((first[:, None] * bs + offs).flatten()).expand(tables.shape[0], -1)
    prefill = []
    for s in meta.prefill_seqs:
        # staged: a blocking host-to-device copy would sync the host once per prefill sequence
        idx = to_device(torch.tensor(list(range(k, -(-s.ctx_len // bs), n)), dtype=torch.long), dev)
        local = to_device(torch.tensor(s.block_table, dtype=torch.long), dev)[idx] // n
        prefill.append((local, (idx[:, None] * bs + offs).flatten()))
    return LocalView(staged[0], staged[1], tables // n, pos, prefill)


def partial(score: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over this rank's keys, unnormalised across ranks. score [..., L] with -inf where
    a key is not visible; values [..., L, D] broadcastable. Returns (o [..., D], lse [...]), o = 0 and
    lse = -inf for a row that sees none of this rank's keys."""
    score = score.float()
    lse = torch.logsumexp(score, dim=-1)
    p = torch.exp(score - lse.unsqueeze(-1)).nan_to_num(0.0)  # a row of -inf: exp(nan) -> 0
    return (p.to(values.dtype) @ values), lse


def merge(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """o [N, T, h, D] and lse [N, T, h] of the N ranks' partials -> [T, h, D]."""
    total = torch.logsumexp(lse, dim=0)  # [T, h]: finite (rank 0 holds every sequence's first block)
    w = torch.exp(lse - total).nan_to_num(0.0)  # [N, T, h]
    return (w.unsqueeze(-1) * o.float()).sum(0).to(o.dtype)
