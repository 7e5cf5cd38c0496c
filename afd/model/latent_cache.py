"""An MLA layer's paged cache, laid out as two planes: every slot's latent c (C values), then every slot's
rotated shared key k_rot (R values).

The tensor is the one the KV cache allocates per MLA, [num_blocks, block_size, C + R], so nothing that only
holds it changes; MLA reads its memory as c [num_blocks, block_size, C] followed by k_rot [num_blocks,
block_size, R], both contiguous. Why not C + R values per slot side by side: a fused decode kernel takes the
latent and rope caches as two paged tensors, and FIA's document requires both contiguous
(`Backend.paged_mla_decode`, afd/backend/npu_attention.py); interleaved rows made each a strided view.
"""

from __future__ import annotations

import torch

from afd.model.attention_metadata import store_kv


def planes(cache: torch.Tensor, C: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cache [nb, bs, C + R] (contiguous) -> (c [nb, bs, C], k_rot [nb, bs, R]), views of its memory."""
    nb, bs, D = cache.shape
    flat = cache.view(-1)
    n = nb * bs * C
    return flat[:n].view(nb, bs, C), flat[n:].view(nb, bs, D - C)


def store(cache: torch.Tensor, slots: torch.Tensor, c: torch.Tensor, k_rot: torch.Tensor) -> None:
    """Writes c [T, C] and k_rot [T, R] at the flat slots [T]."""
    cc, kr = planes(cache, c.shape[-1])
    store_kv(cc, slots, c)
    store_kv(kr, slots, k_rot)


def read(cache: torch.Tensor, C: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots of `blocks` [n] in order: (c [n * bs, C], k_rot [n * bs, R]), copies."""
    cc, kr = planes(cache, C)
    return cc.index_select(0, blocks).flatten(0, 1), kr.index_select(0, blocks).flatten(0, 1)
