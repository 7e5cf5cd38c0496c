"""Building blocks shared by the attention half: RMSNorm, rotary embedding, dense SwiGLU MLP."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from afd.model.tp.comm import SINGLE


class RMSNorm(nn.Module):
    """x normed in fp32. Where the result is cast back to x's dtype is the one thing HF's families differ
    in: before the weight multiplies it (LlamaRMSNorm's order, the default), or after (`weight_in_fp32`:
    DeepSeek-V4's, whose norm weights stay fp32)."""

    weight_in_fp32: ClassVar[bool] = False

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_fp32:
            return (self.weight * xf).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class DenseMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Under TP (afd.model.tp.shard) gate/up hold this rank's rows
    and down_proj sums over the group: x and the result are in the residual stream's layout."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.tp = SINGLE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tp.gather(x)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Rotary:
    """Rotary tables for DeepSeek-style interleaved pairs (x0, x1), (x2, x3), ... of the rope dims."""

    def __init__(self, dim: int, theta: float):
        # Built on the CPU explicitly: halves are constructed under a meta-device context.
        exps = torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim
        self.inv_freq = 1.0 / (theta**exps)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:  # once: a copy per call would sync the host every step
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq  # [T, dim/2]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., dim]; cos/sin [T, dim/2]. Output keeps HF's layout: rotated evens, then rotated odds."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def apply_rotary_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate_half layout (DeepSeek's `rope_interleave: false`): pairs (x_j, x_{j + dim/2})."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class YarnRotary(Rotary):
    """YaRN rope, as transformers' `_compute_yarn_parameters` builds it (same float ops in the same order,
    so the tables are bit-identical): per frequency a blend of the original (extrapolated) and the
    `factor`-stretched (interpolated) inverse frequency, ramped between the dims that turn beta_fast and
    beta_slow times over the original context; cos and sin are scaled by `attention_factor`."""

    def __init__(
        self,
        dim: int,
        theta: float,
        factor: float,
        original_max_position_embeddings: int,
        beta_fast: float = 32,
        beta_slow: float = 1,
        attention_factor: float = 1.0,
        truncate: bool = True,
    ):
        def correction_dim(rotations: float) -> float:
            return dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # HF's guard against a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
        extrapolate = 1 - ramp  # 1: keep the original frequency, 0: stretch it by `factor`
        pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
        self.inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolate) + 1.0 / pos_freqs * extrapolate
        self.attention_factor = attention_factor

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:  # once: a copy per call would sync the host every step
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq  # [T, dim/2]
        return (freqs.cos() * self.attention_factor).to(dtype), (freqs.sin() * self.attention_factor).to(dtype)


def read_directly(linear: nn.Linear) -> nn.Linear:
    """`linear`, marked as one whose weight its module reads itself (a view, a cast), not only through forward:
    it stays a plain tensor, whatever layout the backend would hold it in (afd.backend.cpu_packed)."""
    vars(linear)["reads_weight"] = True  # a plain attribute: nn.Module's setattr types it as a tensor or module
    return linear
