"""Executes one forward step of the attention side over a batch of sequences.

The batch is cut into micro-batches (by sequence). Layer l of micro-batch i hands its MoE input to the
exchange and runs its overlap window; the MoE output is awaited only when micro-batch i enters layer
l + 1, so micro-batch i's exchange also hides behind the other micro-batches' work (ping-pong).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from afd.dataplane.exchange import MoEExchange, Ready
from afd.dataplane.overlap import MicroBatchTuner
from afd.engine.kv_cache import KVCache
from afd.model.attention_metadata import AttentionMetadata


@dataclass
class StepSeq:
    """One sequence's share of a step: new tokens appended after `start` cached ones."""

    token_ids: list[int]
    start: int
    block_table: list[int]


def split_micro_batches(seqs: list[StepSeq], m: int) -> list[list[int]]:
    """Contiguous groups of sequence indices with balanced token counts (some may be empty)."""
    total = sum(len(s.token_ids) for s in seqs)
    groups: list[list[int]] = [[] for _ in range(m)]
    acc, g = 0, 0
    for idx, s in enumerate(seqs):
        while g < m - 1 and acc >= total * (g + 1) / m:
            g += 1
        groups[g].append(idx)
        acc += len(s.token_ids)
    return groups


@dataclass
class _MicroBatch:
    index: int
    rows: list[int]  # indices into the step's sequence list
    meta: AttentionMetadata
    rope: tuple
    x: torch.Tensor
    h: torch.Tensor | None = None
    m: torch.Tensor | None = None
    pending: object = None


class ModelRunner:
    def __init__(self, attn: nn.Module, moe: MoEExchange, kv: KVCache, device: torch.device,
                 micro_batches: int = 1, overlap: bool = True):
        """micro_batches: 1..4, or 0 to choose from measured times (afd.dataplane.overlap)."""
        self.attn, self.moe, self.kv, self.device = attn, moe, kv, device
        self.overlap = overlap
        self.tuner = MicroBatchTuner() if micro_batches == 0 and overlap else None
        self._fixed_micro_batches = max(1, micro_batches)
        self.last_micro_batches = 0
        """What the last step ran with (afd_micro_batches): the tuner may choose anew right after it."""

    @property
    def micro_batches(self) -> int:
        return self.tuner.micro_batches if self.tuner else self._fixed_micro_batches

    @torch.inference_mode()
    def execute(self, seqs: list[StepSeq]) -> torch.Tensor:
        """Runs the step; returns fp32 logits of each sequence's last new token, [B, V]."""
        t0, wait0 = time.perf_counter(), self.moe.timers.total("ffn_wait")
        self.last_micro_batches = self.micro_batches
        mbs = [self._prepare(i, rows, seqs)
               for i, rows in enumerate(split_micro_batches(seqs, self.last_micro_batches))]
        self.moe.begin_step([mb.meta.num_tokens for mb in mbs])
        L = self.attn.cfg.num_layers
        live = [mb for mb in mbs if mb.rows]  # an empty micro-batch sends nothing
        for layer in range(L):
            for mb in live:
                if layer > 0:
                    self._finish(layer - 1, mb)
                self._start(layer, mb)
        for mb in live:
            self._finish(L - 1, mb)
        self.moe.end_step()
        logits = torch.empty(len(seqs), self.attn.cfg.vocab_size, device=self.device)
        for mb in live:
            last = torch.tensor([s.q_start + s.q_len - 1 for s in mb.meta.seqs], device=self.device)
            logits[mb.rows] = self.attn.logits(mb.x[last])
        if self.tuner:
            waited = self.moe.timers.total("ffn_wait") - wait0
            decode = all(len(s.token_ids) == 1 for s in seqs)
            self.tuner.observe(time.perf_counter() - t0, waited, decode, len(seqs))
        return logits

    def _prepare(self, index: int, rows: list[int], seqs: list[StepSeq]) -> _MicroBatch:
        part = [seqs[r] for r in rows]
        meta = AttentionMetadata.build([s.start for s in part], [len(s.token_ids) for s in part],
                                       [s.block_table for s in part], self.kv.block_size, self.device)
        ids = torch.tensor([t for s in part for t in s.token_ids], dtype=torch.long, device=self.device)
        x, rope = self.attn.embed(ids, meta)
        return _MicroBatch(index, rows, meta, rope, x)

    def _start(self, layer: int, mb: _MicroBatch) -> None:
        mb.h, mb.m = self.attn.pre_moe(layer, mb.x, mb.rope, mb.meta, self.kv.layer(layer))
        if mb.m is None:  # a dense layer: nothing crosses (the FFN nodes skip it too: cfg.moe_layers)
            return
        mb.pending = self.moe.submit(layer, mb.index, mb.m)
        if not self.overlap:
            mb.pending = Ready(mb.pending.wait())

    def _finish(self, layer: int, mb: _MicroBatch) -> None:
        h = self.attn.post_moe(layer, mb.h, mb.m, mb.rope, mb.meta, self.kv.layer(layer))
        mb.x = h if mb.pending is None else h + mb.pending.wait()
        mb.h = mb.m = mb.pending = None
