"""Executes one forward step of the attention side over a batch of sequences.

The batch is cut into micro-batches (by sequence). Layer l of micro-batch i hands its MoE input to the
exchange and runs its overlap window; the MoE output is awaited only when micro-batch i enters layer
l + 1, so micro-batch i's exchange also hides behind the other micro-batches' work (ping-pong).

Under tensor parallelism (afd.model.tp) every rank of the attention node runs the same step in lockstep:
the leader (TP rank 0) schedules, sends the step to the others (`follow` runs it there) and samples;
each rank exchanges only its own rows with the MoE (its token shard, or its slice of a replicated
micro-batch), so the FFN side sees G peers per attention node.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from afd.dataplane.exchange import MoEExchange, Ready
from afd.dataplane.overlap import MicroBatchTuner
from afd.engine.graph_half import GraphHalf
from afd.engine.kv_cache import KVCache
from afd.model.attention_metadata import AttentionMetadata
from afd.model.tp.comm import SINGLE, TPComm
from afd.model.tp.config import ShardPlan


@dataclass
class StepSeq:
    """One sequence's share of a step: new tokens appended after `start` cached ones."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    num_logits: int = 1
    """Logits rows the step returns for it: of its last token, or of its last 1 + d when it verifies d
    draft tokens (speculative decoding)."""


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
    plan: ShardPlan
    h: torch.Tensor | None = None
    m: torch.Tensor | None = None
    pending: object = None


class ModelRunner:
    def __init__(
        self,
        attn: nn.Module,
        moe: MoEExchange,
        kv: KVCache,
        device: torch.device,
        micro_batches: int = 1,
        overlap: bool = True,
        tp: TPComm = SINGLE,
        mtp: nn.Module | None = None,
    ):
        """micro_batches: 1..4, or 0 to choose from measured times (afd.dataplane.overlap). tp: the
        attention node's TP group (attn cut to this rank's share by afd.model.tp.shard). mtp: the
        checkpoint's MTP module (afd.model.mtp), for speculative decoding (`draft`)."""
        self.attn, self.moe, self.kv, self.device, self.tp = attn, moe, kv, device, tp
        self.graph = attn if isinstance(attn, GraphHalf) else None
        """Graph mode (afd.engine.graph): told where each step begins."""
        self.overlap = overlap
        self.tuner = MicroBatchTuner() if micro_batches == 0 and overlap else None
        self._fixed_micro_batches = max(1, micro_batches)
        self.last_micro_batches = 0
        """What the last step ran with (afd_micro_batches): the tuner may choose anew right after it."""
        self.mtp = mtp
        self.mtp_kv = (
            None
            if mtp is None
            else torch.zeros(
                mtp.kv_cache_shape(kv.allocator.num_blocks, kv.block_size), dtype=kv.data.dtype, device=device
            )
        )
        """The MTP block's own KV cache layer, addressed by the main model's block tables."""
        self.last_hidden: torch.Tensor | None = None
        """With an MTP module: every token's final hidden state [T, H] of the last step (what the head
        reads), in the step's token order: the drafts' input."""

    @property
    def micro_batches(self) -> int:
        return self.tuner.micro_batches if self.tuner else self._fixed_micro_batches

    @torch.inference_mode()
    def execute(self, seqs: list[StepSeq], micro_batches: int | None = None) -> torch.Tensor:
        """Runs the step; returns fp32 logits [sum of num_logits, V]: each sequence's last new token's, or with
        drafts to verify its last 1 + d tokens', in sequence order. micro_batches:
        the leader's choice, on the other TP ranks (each rank's tuner would measure its own times)."""
        t0, wait0 = time.perf_counter(), self.moe.timers.total("ffn_wait")
        self.last_micro_batches = micro_batches or self.micro_batches
        if self.tp.size > 1 and self.tp.is_leader:
            self.tp.send_step(("step", seqs, self.last_micro_batches))
        mbs = [
            self._prepare(i, rows, seqs) for i, rows in enumerate(split_micro_batches(seqs, self.last_micro_batches))
        ]
        if self.graph is not None:
            self.graph.begin_step([mb.meta for mb in mbs], [mb.rope for mb in mbs])
        self.moe.begin_step([self._moe_rows(mb) for mb in mbs])
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
        first = [0]
        for s in seqs:
            first.append(first[-1] + s.num_logits)
        logits = torch.empty(first[-1], self.attn.cfg.vocab_size, device=self.device)
        hidden = []
        for mb in live:
            src = [
                s.q_start + s.q_len - k for r, s in zip(mb.rows, mb.meta.seqs) for k in range(seqs[r].num_logits, 0, -1)
            ]  # each sequence's last num_logits rows
            dst = [first[r] + j for r in mb.rows for j in range(seqs[r].num_logits)]
            with self.tp.plan(mb.plan):
                x = self.tp.gather(mb.x)
                logits[dst] = self.attn.logits(x[torch.tensor(src, device=self.device)])
                if self.mtp is not None:
                    hidden.append(self.attn.norm(x))
        self.last_hidden = torch.cat(hidden) if hidden else None
        if self.tuner:
            waited = self.moe.timers.total("ffn_wait") - wait0
            decode = all(len(s.token_ids) == s.num_logits for s in seqs)  # decode, drafts included
            self.tuner.observe(time.perf_counter() - t0, waited, decode, len(seqs))
        return logits

    def _prepare(self, index: int, rows: list[int], seqs: list[StepSeq]) -> _MicroBatch:
        part = [seqs[r] for r in rows]
        meta = AttentionMetadata.build(
            [s.start for s in part],
            [len(s.token_ids) for s in part],
            [s.block_table for s in part],
            self.kv.block_size,
            self.device,
        )
        ids = torch.tensor([t for s in part for t in s.token_ids], dtype=torch.long, device=self.device)
        plan = self.tp.plan_for(meta.num_tokens)
        with self.tp.plan(plan):
            x, rope = self.attn.embed(ids, meta)
        return _MicroBatch(index, rows, meta, rope, x, plan)

    def _moe_rows(self, mb: _MicroBatch) -> int:
        """How many of the micro-batch's tokens this rank exchanges with the MoE."""
        if not mb.rows:
            return 0
        with self.tp.plan(mb.plan):
            lo, hi = self.tp.moe_rows()
        return hi - lo

    def _start(self, layer: int, mb: _MicroBatch) -> None:
        with self.tp.plan(mb.plan):
            mb.h, mb.m = self.attn.pre_moe(layer, mb.x, mb.rope, mb.meta, self.kv.layer(layer))
            lo, hi = self.tp.moe_rows()
        if mb.m is None:  # a dense layer: nothing crosses (the FFN nodes skip it too: cfg.moe_layers)
            return
        if hi == lo:  # under TP, a rank with no rows of this micro-batch sends nothing (its header said 0)
            mb.pending = Ready(mb.m[:0])
            return
        mb.pending = self.moe.submit(layer, mb.index, mb.m[lo:hi])
        if not self.overlap:
            mb.pending = Ready(mb.pending.wait())

    def _finish(self, layer: int, mb: _MicroBatch) -> None:
        with self.tp.plan(mb.plan):
            h = self.attn.post_moe(layer, mb.h, mb.m, mb.rope, mb.meta, self.kv.layer(layer))
            mb.x = h if mb.pending is None else h + self.tp.moe_output(mb.pending.wait())
        mb.h = mb.m = mb.pending = None

    # ---- the MTP module's forward (speculative decoding) --------------------------------------------

    @torch.inference_mode()
    def mtp_step(self, seqs: list[StepSeq], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP module over sequences whose `token_ids` are the tokens at start + 1 ... (each one
        position after the hidden state it pairs with) and `hidden` [T, H] those hidden states, in order.
        Writes its KV cache layer at positions start ...; returns, at each sequence's last position, its
        own hidden state [B, H] (the next draft's input) and fp32 logits [B, V] of the token after next.
        Its MoE crosses as one FLAG_MTP step of one micro-batch (none for a dense MTP block)."""
        mtp = self.mtp
        meta = AttentionMetadata.build(
            [s.start for s in seqs],
            [len(s.token_ids) for s in seqs],
            [s.block_table for s in seqs],
            self.kv.block_size,
            self.device,
        )
        ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.long, device=self.device)
        e, rope = self.attn.embed(ids, meta)  # the main model's embedding and rotary tables
        x = mtp.fuse(e, hidden)  # [T, H]
        h, m = mtp.block.pre_moe(x, rope, meta, self.mtp_kv)
        pending = None
        if m is not None:
            self.moe.begin_step([meta.num_tokens], mtp=True)
            pending = self.moe.submit(mtp.moe_layer, 0, m)
        h = mtp.block.post_moe(h, m, rope, meta, self.mtp_kv)
        if pending is not None:
            h = h + pending.wait()
            self.moe.end_step()
        last = torch.tensor([s.q_start + s.q_len - 1 for s in meta.seqs], device=self.device)
        out = mtp.norm(h[last])  # [B, H]
        return out, self.attn.lm_head(out).float()

    # ---- steps without tokens, mirrored on the other TP ranks ---------------------------------------

    def idle(self) -> int:
        """An empty step (afd.dataplane.exchange.MoEExchange.idle)."""
        if self.tp.size > 1 and self.tp.is_leader:
            self.tp.send_step(("idle",))
        return self.moe.idle()

    def leave(self, shutdown: bool = False, reform: bool = False) -> None:
        if self.tp.size > 1 and self.tp.is_leader:
            self.tp.send_step(("leave", shutdown, reform))
        self.moe.leave(shutdown=shutdown, reform=reform)


def follow(runner: ModelRunner) -> tuple:
    """A TP rank other than the leader: runs what the leader sends, until it leaves. Returns the leave
    message ("leave", shutdown, reform)."""
    while True:
        msg = runner.tp.recv_step()
        if msg[0] == "step":
            runner.execute(msg[1], micro_batches=msg[2])
        elif msg[0] == "idle":
            runner.moe.idle()
        else:
            runner.moe.leave(shutdown=msg[1], reform=msg[2])
            return msg
