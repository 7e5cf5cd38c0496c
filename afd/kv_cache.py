"""Paged KV cache: fixed-size blocks of MLA latents, handed out by a plain-Python allocator."""

from __future__ import annotations

import torch

from afd.config import ModelConfig


class OutOfBlocks(RuntimeError):
    """The cache has fewer free blocks than a request needs."""


class BlockAllocator:
    """Free-list allocator of block ids [0, num_blocks)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class KVCache:
    """Latents of every attention sublayer: [num_layers, 2, num_blocks, block_size, C + R]."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.data = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.latent_dim, dtype=dtype,
                                device=device)

    def layer(self, i: int) -> torch.Tensor:
        return self.data[i]

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Extend a sequence's block table in place so that it can hold num_tokens tokens."""
        need = blocks_needed(num_tokens, self.block_size) - len(table)
        if need > 0:
            table.extend(self.allocator.allocate(need))

    def usage(self) -> float:
        a = self.allocator
        return 1.0 - a.num_free / a.num_blocks
