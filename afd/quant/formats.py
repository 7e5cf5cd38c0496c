"""The tensor math of afd's quantized formats, on any device, in the orientation a checkpoint stores a
linear's weight: [N, K] (out, in).

A quantized weight is (q, scale): q [N, K] in 8 bits, scale fp32 [N, Kb], one scale per output channel and
K-block of `bk` columns (Kb = ceil(K / bk)), so that weight[n, k] = q[n, k] * scale[n, k // bk]. FP8 blocks
of (bn, bk) store the same scale for the bn rows of a block; int8 per channel has one K-block (bk = K).
Scales per row rather than per row-block cost N * Kb floats (under 1% of the bytes at bk = 128) and let
rows be concatenated or cut anywhere (gate | up, TP shards) without re-blocking.
"""

from __future__ import annotations

import math

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
INT8_MAX = 127.0
QUANT_DTYPES = (torch.int8, FP8)


def block_k(weights: str, block: tuple[int, int], k: int) -> int:
    """The K-block of a format: the FP8 block's columns, or all K (int8 per channel)."""
    return block[1] if weights == "fp8_block" else k


def expand_block_scale(scale_inv: torch.Tensor, n: int, bn: int) -> torch.Tensor:
    """A checkpoint's block scales [ceil(N / bn), Kb] -> per-row scales [N, Kb]."""
    return scale_inv.float().repeat_interleave(bn, dim=0)[:n].contiguous()


def _blocks_amax(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """[N, K] -> absmax of each (bn, bk) block [ceil(N / bn), ceil(K / bk)], partial blocks at the edges."""
    N, K = w.shape
    Nb, Kb = math.ceil(N / bn), math.ceil(K / bk)
    padded = torch.zeros(Nb * bn, Kb * bk, dtype=torch.float32, device=w.device)
    padded[:N, :K] = w.abs()
    return padded.view(Nb, bn, Kb, bk).amax(dim=(1, 3))


def _tiny() -> float:
    return torch.finfo(torch.float32).tiny


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q float8_e4m3fn [N, K], scale_inv fp32 [ceil(N / bn), ceil(K / bk)]): each block scaled
    so that its absmax is FP8's largest finite value (the checkpoints' own rule)."""
    bn, bk = block
    N, K = w.shape
    scale = _blocks_amax(w, bn, bk).clamp(min=_tiny()) / FP8_MAX  # an all-zero block: bits 0
    full = scale.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    q = (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_int8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K], scale fp32 [N, 1]): symmetric, absmax / 127 per output channel."""
    wf = w.float()
    scale = wf.abs().amax(dim=1, keepdim=True).clamp(min=_tiny()) / INT8_MAX
    return (wf / scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, bk: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q [..., N, K], scale [..., N, Kb]) with K-blocks of `bk` -> the weight [..., N, K] in `dtype`: widened
    to fp32 and multiplied once (fp8 and int8 values are exact in fp32), then rounded to `dtype`."""
    K, Kb = q.shape[-1], scale.shape[-1]
    if Kb != math.ceil(K / bk):
        raise ValueError(f"scales {tuple(scale.shape)} do not cover {K} columns in blocks of {bk}")
    full = scale.repeat_interleave(bk, dim=-1)[..., :K] if Kb > 1 else scale
    return (q.float() * full).to(dtype)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [T, K] -> (int8 [T, K], fp32 scale [T, 1]): per token, dynamic absmax / 127."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=_tiny()) / INT8_MAX
    return (xf / scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_rows_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [T, K] -> (float8_e4m3fn [T, K], fp32 scale [T, ceil(K / group)]): per token and
    `group`-wide slice of the row, dynamic absmax / 448 (DeepSeek's act_quant with its block of 128)."""
    T, K = x.shape
    Kb = math.ceil(K / group)
    xf = torch.zeros(T, Kb * group, dtype=torch.float32, device=x.device)
    xf[:, :K] = x.float()
    scale = xf.view(T, Kb, group).abs().amax(dim=2).clamp(min=_tiny()) / FP8_MAX  # [T, Kb]
    q = (xf.view(T, Kb, group) / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(T, Kb * group)[:, :K], scale
