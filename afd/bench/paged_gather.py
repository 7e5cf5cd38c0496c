"""The whole-sequence gather that paged attention replaced (afd/model/paged_attention.py), kept only as
`afd bench-paged`'s reference: `implementation` patches it, or a chunk size, in for the steps that time it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

from afd.model import latent_cache, paged_attention
from afd.model.gqa import GQAttention
from afd.model.mla import MLAttention

BEFORE = "gather (before)"


def _mla_gather(self: MLAttention, q_nope, q_rot, meta, cache) -> torch.Tensor:
    """MLAttention._decode_absorbed as it was: every sequence's whole cache copied out, one softmax."""
    w_uk, w_uv = self._w_uk_uv()
    q_full = torch.cat([torch.einsum("bhn,hnc->bhc", q_nope, w_uk), q_rot], dim=-1)  # [B, NH, C + R]
    B, nb = meta.decode_block_tables.shape
    c, k_rot = latent_cache.planes(cache, self.kv_lora)
    kv = torch.cat([c[meta.decode_block_tables], k_rot[meta.decode_block_tables]], dim=-1)  # [B, nb, bs, C + R]
    kv = kv.view(B, nb * meta.block_size, -1)  # [B, L, C + R]
    score = torch.einsum("bhd,bld->bhl", q_full, kv) * self.scale
    pos = torch.arange(kv.shape[1], device=kv.device)
    score.masked_fill_(pos[None, None, :] >= meta.decode_ctx_lens[:, None, None], float("-inf"))
    p = torch.softmax(score, dim=-1, dtype=torch.float32).to(q_full.dtype)
    o_lat = torch.einsum("bhl,blc->bhc", p, kv[..., : self.kv_lora])  # [B, NH, C]
    return torch.einsum("bhc,hvc->bhv", o_lat, w_uv)


def _gqa_gather(self: GQAttention, q, meta, cache) -> torch.Tensor:
    """GQAttention._decode as it was. q [B, KVH, G, D]."""
    B, nb = meta.decode_block_tables.shape
    k = cache[0][meta.decode_block_tables].view(B, nb * meta.block_size, self.n_kv, -1)  # [B, L, KVH, D]
    v = cache[1][meta.decode_block_tables].view(B, nb * meta.block_size, self.n_kv, -1)
    score = torch.einsum("bkgd,blkd->bkgl", q, k) * self.scale
    pos = torch.arange(k.shape[1], device=k.device)
    score.masked_fill_(pos >= meta.decode_ctx_lens[:, None, None, None], float("-inf"))
    p = torch.softmax(score, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("bkgl,blkd->bkgd", p, v)


@contextlib.contextmanager
def gather_decode() -> Iterator[None]:
    """Decode through the whole-sequence gather (MLA and GQA) while inside."""
    with (
        mock.patch.object(MLAttention, "_decode_absorbed", _mla_gather),
        mock.patch.object(GQAttention, "_decode", _gqa_gather),
    ):
        yield


@contextlib.contextmanager
def implementation(name: str) -> Iterator[None]:
    if name == BEFORE:
        with gather_decode():
            yield
    else:
        with mock.patch.object(paged_attention, "CHUNK_BLOCKS", int(name.split("=")[1])):
            yield
