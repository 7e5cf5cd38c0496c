"""What an MLA layer hands a backend's fused decode prolog at load, and what the prepared prolog is called with
(`Backend.mla_prolog`; Ascend's is afd/backend/npu_prolog.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class MLAPrologWeights:
    """One MLA layer's projections before attention, as afd holds them, for a backend's fused prolog
    (`Backend.mla_prolog`). nn.Linear weights are [out, in]; N is the heads on this rank, D / Dr the nope / rope
    head widths, C the kv LoRA rank, Hcq the q LoRA rank, He the hidden size."""

    q_a: torch.Tensor | None
    """q_a_proj.weight [Hcq, He]; None where q is projected without a LoRA."""
    q_b: torch.Tensor | None
    """q_b_proj.weight [N (D + Dr), Hcq]: per head its nope rows, then its rope rows."""
    q_norm: torch.Tensor | None
    """q_a_layernorm's gamma [Hcq]."""
    kv_a: torch.Tensor
    """kv_a_proj_with_mqa.weight [C + Dr, He]: the latent rows, then the shared rope key's."""
    kv_norm: torch.Tensor
    """kv_a_layernorm's gamma [C]."""
    w_uk: torch.Tensor
    """[N, D, C]: kv_b_proj's nope rows per head (the query's absorption into latent space)."""
    eps: float
    """Both latent RMSNorms' epsilon."""
    q_scale: float
    """Multiplies q (nope and rope) after q_a_layernorm (LongCat-Flash's LoRA scale; 1 elsewhere)."""
    kv_scale: float
    """Multiplies the normalised latent c (not the rope key)."""
    rope_interleave: bool
    """Rope dims rotated as interleaved pairs (HF's rope_interleave, written out as [evens, odds]), else in
    halves; either way MLA caches the rotated key in halves order."""
    bias: bool
    """Whether the down-projections carry a bias (attention_bias)."""


class MLAProlog(Protocol):
    """A layer's fused decode prolog, prepared once by `Backend.mla_prolog`."""

    def takes(self, kv_c: torch.Tensor, kv_r: torch.Tensor) -> bool:
        """Whether it takes this layer's latent [nb, bs, C] and rope [nb, bs, Dr] caches (asked before MLA
        gathers the step's tokens for it; a backend logs why not)."""
        ...

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_c: torch.Tensor,
        kv_r: torch.Tensor,
        slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, He] (every token of the step, each one sequence's next); cos / sin [T, Dr / 2], MLA's rotary
        tables; kv_c [nb, bs, C] and kv_r [nb, bs, Dr] the layer's latent and rope caches; slots [T] int64.
        Writes each token's c and rotated key at its slot and returns (q_lat [T, N, C], the query absorbed
        through W_UK, q_rot [T, N, Dr] rotated, in halves order), both scaled by q_scale, as MLA's own
        projections would make them. Called only where `takes` holds for the caches."""
        ...
