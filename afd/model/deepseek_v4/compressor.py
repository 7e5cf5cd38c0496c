"""CSA / HCA compression and the lightning indexer over a sequence's paged state (afd.model.deepseek_v4.state).

The math is transformers' DeepseekV4{HCA,CSA}Compressor and DeepseekV4Indexer (models/deepseek_v4/
modeling_deepseek_v4.py), but the windows are made from the per-token projections kept in the cache, not from
HF's running buffers: entry w = norm(sum over its slots of kv * softmax(gate + ape)), rotated at position w * r.
A CSA entry spans 2r slots: the previous window's first series (Ca) and its own window's second (Cb); the very
first window's Ca slots weigh nothing (HF's -inf gate). Entry w is visible to the query at position p once
w < (p + 1) // r (its window is complete).

Shapes: n new tokens of one sequence, D head dim (c for the indexer), r rate, o series (2 CSA, 1 HCA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from afd.model.deepseek_v4.layers import RMSNorm, rope


class Compressor(nn.Module):
    """wkv / wgate [o*D, H], ape [r, o*D], norm [D]: the checkpoint's `compressor` (and `indexer.compressor`)."""

    def __init__(self, hidden: int, dim: int, rate: int, series: int, eps: float):
        super().__init__()
        self.dim, self.rate, self.series = dim, rate, series
        self.wkv = nn.Linear(hidden, series * dim, bias=False)
        self.wgate = nn.Linear(hidden, series * dim, bias=False)
        self.ape = nn.Parameter(torch.empty(rate, series * dim))
        self.norm = RMSNorm(dim, eps)

    def entries(self, ckv: torch.Tensor, cgate: torch.Tensor, first: int, n: int, rot) -> torch.Tensor:
        """Entries first .. first + n - 1 [n, D] from the projections ckv / cgate [(n + 1) * r, o*D] of tokens
        (first - 1) * r .. (first + n) * r - 1 (CSA; HCA: [n * r, D] from first * r); the rows before
        position 0 are ignored. rot: the compressed rope (cos / sin of a position tensor)."""
        r, D = self.rate, self.dim
        if self.series == 1:
            kv = ckv.view(n, r, D)
            gate = cgate.view(n, r, D) + self.ape
        else:
            prev_kv, cur_kv = ckv[:-r].view(n, r, 2 * D), ckv[r:].view(n, r, 2 * D)
            prev_g = cgate[:-r].view(n, r, 2 * D) + self.ape
            cur_g = cgate[r:].view(n, r, 2 * D) + self.ape
            kv = torch.cat([prev_kv[..., :D], cur_kv[..., D:]], dim=1)  # [n, 2r, D]
            gate = torch.cat([prev_g[..., :D], cur_g[..., D:]], dim=1)
            if first == 0:  # window 0 has no previous window: its Ca slots weigh nothing
                kv[0, :r] = 0
                gate[0, :r] = float("-inf")
        out = self.norm((kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1))
        pos = torch.arange(first, first + n, device=ckv.device) * r
        return rope(out, *rot(pos))


class Indexer(nn.Module):
    """The lightning indexer of a CSA layer (checkpoint `indexer.*`): its own compressor at index_head_dim,
    wq_b from the query LoRA, weights_proj from the layer input."""

    def __init__(self, hidden: int, q_lora: int, heads: int, dim: int, rate: int, topk: int, eps: float):
        super().__init__()
        self.heads, self.dim, self.rate, self.topk = heads, dim, rate, topk
        self.compressor = Compressor(hidden, dim, rate, 2, eps)
        self.wq_b = nn.Linear(q_lora, heads * dim, bias=False)
        self.weights_proj = nn.Linear(hidden, heads, bias=False)

    def select(
        self, x: torch.Tensor, q_res: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, cos, sin
    ) -> torch.Tensor:
        """Which of the C compressed entries each of the n queries attends: bool [n, C]. x [n, H] the layer
        input, q_res [n, q_lora], keys [C, c] the indexer's entries, cos / sin the queries' compressed rope.
        As HF: scores over all C entries, the incomplete ones at -inf, top-min(k, C), picks past the causal
        bound dropped (the same vector layout, so that ties resolve as HF's topk resolves them)."""
        n, C = x.shape[0], keys.shape[0]
        q = rope(self.wq_b(q_res).view(n, self.heads, self.dim), cos, sin)  # [n, h, c]
        scores = F.relu(torch.matmul(q.float(), keys.t().float())) * self.dim**-0.5  # [n, h, C]
        w = self.weights_proj(x).float() * self.heads**-0.5  # [n, h]
        index = (scores * w.unsqueeze(-1)).sum(dim=1)  # [n, C]
        bound = (positions + 1) // self.rate  # [n]
        future = torch.arange(C, device=x.device)[None, :] >= bound[:, None]  # [n, C]
        picks = index.masked_fill(future, float("-inf")).topk(min(self.topk, C), dim=-1).indices  # [n, k]
        chosen = torch.zeros(n, C, dtype=torch.bool, device=x.device)
        chosen.scatter_(1, picks, True)
        return chosen & ~future
