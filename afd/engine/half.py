"""What the runner calls on an attention half, as a structural type (RunnerHalf): a family's
afd.model.halves.AttentionHalf, or graph mode's GraphHalf, a wrapper rather than a subclass, standing in
for one."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from afd.model.attention_metadata import AttentionMetadata
from afd.model.config import ModelConfig
from afd.model.mtp import MTPLayer
from afd.quant.scheme import QuantSpec

LayerState = Any
"""Layer i's state as afd.engine.kv_cache.KVCache.layer gives it: a tensor (a family with one kind of state), or
an afd.model.state_spec.PagedLayer (several kinds in one page pool: DeepSeek-V4); each family reads its own."""


class RunnerHalf(Protocol):
    """The calls the runner makes on the attention side: afd.model.halves.AttentionHalf's, which a family
    implements and GraphHalf forwards."""

    cfg: ModelConfig

    def embed(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, Any]: ...

    def pre_moe(
        self, i: int, x: torch.Tensor, rope: Any, meta: AttentionMetadata, kv: LayerState
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def post_moe(
        self, i: int, h: torch.Tensor, m: torch.Tensor | None, rope: Any, meta: AttentionMetadata, kv: LayerState
    ) -> torch.Tensor: ...

    def logits(self, x: torch.Tensor) -> torch.Tensor: ...

    def combine(self, i: int, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...

    def moe_reads_token_ids(self, i: int) -> bool: ...

    def mtp_hidden(self, x: torch.Tensor) -> torch.Tensor: ...

    norm: nn.Module
    lm_head: nn.Module

    def prefetch_weights(self, i: int, phase: str) -> list[torch.Tensor]: ...

    quant: QuantSpec | None

    supports_graph: ClassVar[bool]

    unquantized: ClassVar[tuple[str, ...]]


MTPModule = MTPLayer
"""The MTP module the runner drafts with: afd.model.mtp's, which no wrapper stands in for."""
