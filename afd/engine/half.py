"""What the runner calls on a model half, as structural types: families implement the contract's base
classes (afd.model.halves), and graph mode's GraphHalf, a wrapper rather than a subclass, stands in for an
attention half through these Protocols."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from afd.model.attention_metadata import AttentionMetadata
from afd.model.config import ModelConfig


class AttentionHalf(Protocol):
    cfg: ModelConfig

    def embed(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, Any]: ...

    def pre_moe(
        self, i: int, x: torch.Tensor, rope: Any, meta: AttentionMetadata, kv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def post_moe(
        self, i: int, h: torch.Tensor, m: torch.Tensor | None, rope: Any, meta: AttentionMetadata, kv: torch.Tensor
    ) -> torch.Tensor: ...

    def logits(self, x: torch.Tensor) -> torch.Tensor: ...

    def norm(self, x: torch.Tensor) -> torch.Tensor: ...

    def lm_head(self, x: torch.Tensor) -> torch.Tensor: ...

    def prefetch_weights(self, i: int, phase: str) -> list[torch.Tensor]: ...


class MTPBlock(Protocol):
    """A family's decoder block as the MTP module holds it: pre_moe / post_moe over its own KV layer."""

    def pre_moe(
        self, x: torch.Tensor, rope: Any, meta: AttentionMetadata, kv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def post_moe(
        self, h: torch.Tensor, m: torch.Tensor | None, rope: Any, meta: AttentionMetadata, kv: torch.Tensor
    ) -> torch.Tensor: ...


class MTPModule(Protocol):
    block: MTPBlock
    moe_layer: int | None

    def fuse(self, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor: ...

    def norm(self, x: torch.Tensor) -> torch.Tensor: ...

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]: ...
