"""The attention half's layers cut across the ranks of a TP group, named by how they shard.

Column-parallel layers (q_b_proj, kv_b_proj, gate_proj, up_proj) stay plain nn.Linear holding their rows
of the output dimension; the layers below hold a slice and talk to the group (afd.model.tp.comm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from afd.model.tp.comm import TPComm


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


class RowParallelLinear(nn.Module):
    """y = x[:, K/G slice] @ W[:, K/G slice]^T summed over the group (down_proj, o_proj), into the stream's
    layout. The bias is added once, after the sum."""

    linear_weight = True
    """`weight` is read as F.linear's (x @ weight^T): on CPU it is laid out column-major (afd.backend.cpu)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPComm):
        super().__init__()
        self.weight = _frozen(weight)
        self.bias = None if bias is None else _frozen(bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.row_parallel(x, self.weight, self.bias)


class FC2OProj(nn.Module):
    """o_proj under flashcomm2: holds the columns of this rank's ODP group (F/P of them, the inputs its
    OTP ReduceScatter sums over); a micro-batch below the threshold uses this rank's own F/G of them, as
    the allreduce path does."""

    linear_weight = True  # x @ weight^T, as RowParallelLinear

    def __init__(self, block: torch.Tensor, own: slice, bias: torch.Tensor | None, tp: TPComm):
        super().__init__()
        self.weight = _frozen(block)
        self.bias = None if bias is None else _frozen(bias)
        self.own, self.tp = own, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.active.fc2:
            return self.tp.fc2_o_proj(x, self.weight, self.bias)
        return self.tp.row_parallel(x, self.weight[:, self.own], self.bias)


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, lo + V/G) of the (padded) vocabulary; other ids look up zeros, and the group's sum (the
    stream's reduce) assembles every token's embedding."""

    def __init__(self, weight: torch.Tensor, lo: int, tp: TPComm):
        super().__init__()
        self.weight = _frozen(weight)
        self.lo, self.tp = lo, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine[:, None]
        return self.tp.reduce(out)


class ParallelLMHead(nn.Module):
    """Rows [lo, lo + V/G) of lm_head: each rank scores its vocabulary slice, then the slices are gathered."""

    linear_weight = True  # x @ weight^T, as RowParallelLinear

    def __init__(self, weight: torch.Tensor, vocab: int, tp: TPComm):
        super().__init__()
        self.weight = _frozen(weight)
        self.vocab, self.tp = vocab, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.gather_vocab(F.linear(x, self.weight))[:, : self.vocab]
