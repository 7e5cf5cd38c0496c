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
from typing import Any

import torch

from afd.backend.base import to_device
from afd.config.tp import ShardPlan
from afd.dataplane.exchange import MoEExchange, MoEHandle, Ready
from afd.dataplane.overlap import MicroBatchTuner
from afd.engine.graph_half import GraphHalf
from afd.engine.half import MTPModule, RunnerHalf
from afd.engine.kv_cache import KVCache
from afd.engine.messages import DraftOutput, IdleStep, LeaveStep, RunnerOutput, RunStep, StepSeq
from afd.model.attention_metadata import AttentionMetadata
from afd.model.tp.comm import SINGLE, TPComm
from afd.observability.timing import LayerTimes

__all__ = ["ModelRunner", "StepSeq", "follow", "split_micro_batches"]


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
    rope: Any
    x: torch.Tensor
    plan: ShardPlan
    ids: torch.Tensor  # [T] the micro-batch's token ids (a router may read them: moe_reads_token_ids)
    h: torch.Tensor | None = None
    m: torch.Tensor | None = None
    pending: MoEHandle | None = None


class ModelRunner:
    def __init__(
        self,
        attn: RunnerHalf,
        moe: MoEExchange | None,
        kv: KVCache,
        device: torch.device,
        micro_batches: int = 1,
        overlap: bool = True,
        tp: TPComm = SINGLE,
        mtp: MTPModule | None = None,
    ):
        """micro_batches: 1..4, or 0 to choose from measured times (afd.dataplane.overlap). tp: the
        attention node's TP group (attn cut to this rank's share by afd.model.tp.shard). mtp: the
        checkpoint's MTP module (afd.model.mtp), for speculative decoding (`mtp_step`)."""
        self.attn, self.kv, self.device, self.tp = attn, kv, device, tp
        self.moe: MoEExchange | None = moe
        """None while the data plane re-forms (the engine drops the exchange over a failed generation)."""
        self.graph = attn if isinstance(attn, GraphHalf) else None
        """Graph mode (afd.engine.graph): told where each step begins."""
        self.overlap = overlap
        self.tuner = MicroBatchTuner() if micro_batches == 0 and overlap else None
        self._fixed_micro_batches = max(1, micro_batches)
        self.mtp = mtp
        self.mtp_kv = (
            None
            if mtp is None
            else torch.zeros(
                mtp.kv_cache_shape(kv.allocator.num_blocks, kv.block_size), dtype=kv.data.dtype, device=device
            )
        )
        """The MTP block's own KV cache layer, addressed by the main model's block tables."""
        self.layer_times: LayerTimes | None = None
        """Opt-in per-piece timing of each layer (`afd profile`); None (the default) times nothing."""

    @property
    def micro_batches(self) -> int:
        return self.tuner.micro_batches if self.tuner else self._fixed_micro_batches

    def exchange(self) -> MoEExchange:
        if self.moe is None:
            raise RuntimeError("the runner has no MoE exchange (the data plane is re-forming)")
        return self.moe

    @torch.inference_mode()
    def execute(self, seqs: list[StepSeq], micro_batches: int | None = None) -> RunnerOutput:
        """Runs the step. micro_batches: the leader's choice, on the other TP ranks (each rank's tuner
        would measure its own times)."""
        moe = self.exchange()
        t0 = time.perf_counter()
        n = micro_batches or self.micro_batches
        if self.tp.size > 1 and self.tp.is_leader:
            if any(s.drafts is not None for s in seqs):  # the config refuses this pairing; device drafts don't pickle
                raise RuntimeError("speculative decoding runs at attention_tp 1 only")
            self.tp.send_step(RunStep(seqs, n))
        mbs = [self._prepare(i, rows, seqs) for i, rows in enumerate(split_micro_batches(seqs, n))]
        if self.graph is not None:
            self.graph.begin_step([mb.meta for mb in mbs], [mb.rope for mb in mbs])
        moe.begin_step([self._moe_rows(mb) for mb in mbs])
        L = self.attn.cfg.num_layers
        live = [mb for mb in mbs if mb.rows]  # an empty micro-batch sends nothing
        for layer in range(L):
            for mb in live:
                if layer > 0:
                    self._finish(layer - 1, mb)
                self._start(layer, mb)
        for mb in live:
            self._finish(L - 1, mb)
        exchanged = moe.end_step()
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
                rows = self.attn.logits(x[to_device(torch.tensor(src), self.device)])
                logits[to_device(torch.tensor(dst), self.device)] = rows
                if self.mtp is not None:
                    hidden.append(self.attn.mtp_hidden(x))
        if self.tuner:
            decode = all(len(s.token_ids) == s.num_logits for s in seqs)  # decode, drafts included
            self.tuner.observe(time.perf_counter() - t0, exchanged.ffn_wait, decode, len(seqs))
        return RunnerOutput(logits, torch.cat(hidden) if hidden else None, n, exchanged)

    def _prepare(self, index: int, rows: list[int], seqs: list[StepSeq]) -> _MicroBatch:
        part = [seqs[r] for r in rows]
        meta = AttentionMetadata.build(
            [s.start for s in part],
            [len(s.token_ids) for s in part],
            [s.block_table for s in part],
            self.kv.block_size,
            self.device,
        )
        ids = token_ids(part, self.device)
        plan = self.tp.plan_for(meta.num_tokens)
        with self.tp.plan(plan):
            x, rope = self.attn.embed(ids, meta)
        return _MicroBatch(index, rows, meta, rope, x, plan, ids)

    def _moe_rows(self, mb: _MicroBatch) -> int:
        """How many of the micro-batch's tokens this rank exchanges with the MoE."""
        if not mb.rows:
            return 0
        with self.tp.plan(mb.plan):
            lo, hi = self.tp.moe_rows()
        return hi - lo

    def _start(self, layer: int, mb: _MicroBatch) -> None:
        timed = self.layer_times
        t0 = time.perf_counter() if timed is not None else 0.0
        with self.tp.plan(mb.plan):
            mb.h, mb.m = self.attn.pre_moe(layer, mb.x, mb.rope, mb.meta, self.kv.layer(layer))
            lo, hi = self.tp.moe_rows()
        if timed is not None:
            t1 = time.perf_counter()
            timed.add("dense" if mb.m is None else "pre", layer, mb.meta.num_tokens, t1 - t0)
        if mb.m is None:  # a dense layer: nothing crosses (the FFN nodes skip it too: cfg.moe_layers)
            return
        if hi == lo:  # under TP, a rank with no rows of this micro-batch sends nothing (its header said 0)
            mb.pending = Ready(mb.m[:0])
            return
        kw = {"token_ids": mb.ids[lo:hi]} if self.attn.moe_reads_token_ids(layer) else {}
        mb.pending = self.exchange().submit(layer, mb.index, mb.m[lo:hi], **kw)
        if not self.overlap:
            mb.pending = Ready(mb.pending.wait())
        if timed is not None:
            timed.add("moe", layer, hi - lo, time.perf_counter() - t1)

    def _finish(self, layer: int, mb: _MicroBatch) -> None:
        assert mb.h is not None  # _start ran first
        timed = self.layer_times
        t0 = time.perf_counter() if timed is not None else 0.0
        with self.tp.plan(mb.plan):
            h = self.attn.post_moe(layer, mb.h, mb.m, mb.rope, mb.meta, self.kv.layer(layer))
            if timed is not None:  # a dense layer's post_moe counts as the dense layer's
                timed.add(
                    "dense" if mb.pending is None else "window", layer, mb.meta.num_tokens, time.perf_counter() - t0
                )
                if mb.pending is None:
                    mb.x = h
                else:
                    y = mb.pending.wait()  # the wait is the exchange's (ffn_wait), not the combine's
                    t0 = time.perf_counter()
                    mb.x = self.attn.combine(layer, h, self.tp.moe_output(y))
                    timed.add("combine", layer, mb.meta.num_tokens, time.perf_counter() - t0)
            else:
                mb.x = h if mb.pending is None else self.attn.combine(layer, h, self.tp.moe_output(mb.pending.wait()))
        mb.h = mb.m = mb.pending = None

    # ---- the MTP module's forward (speculative decoding) --------------------------------------------

    @torch.inference_mode()
    def mtp_step(self, seqs: list[StepSeq], hidden: torch.Tensor) -> DraftOutput:
        """The MTP module over sequences whose `token_ids` are the tokens at start + 1 ... (each one
        position after the hidden state it pairs with) and `hidden` [T, H] those hidden states, in order.
        Writes its KV cache layer at positions start ...; returns its output at each sequence's last
        position. Its MoE crosses as one FLAG_MTP step of one micro-batch (none for a dense MTP block)."""
        mtp, kv = self.mtp, self.mtp_kv
        if mtp is None or kv is None:
            raise RuntimeError("mtp_step needs the runner built with the checkpoint's MTP module")
        meta = AttentionMetadata.build(
            [s.start for s in seqs],
            [len(s.token_ids) for s in seqs],
            [s.block_table for s in seqs],
            self.kv.block_size,
            self.device,
        )
        ids = token_ids(seqs, self.device)
        e, rope = self.attn.embed(ids, meta)  # the main model's embedding and rotary tables
        x = mtp.fuse(e, hidden)  # [T, H]
        h, m = mtp.block.pre_moe(x, rope, meta, kv)
        pending = None
        if m is not None:
            moe = self.exchange()
            moe.begin_step([meta.num_tokens], mtp=True)
            pending = moe.submit(_layer_id(mtp.moe_layer), 0, m)
        h = mtp.block.post_moe(h, m, rope, meta, kv)
        if pending is not None:
            h = mtp.combine(h, pending.wait())
            self.exchange().end_step()
        last = to_device(torch.tensor([s.q_start + s.q_len - 1 for s in meta.seqs]), self.device)
        chain, out = mtp.draft(h[last])  # what the next draft step starts from; the lm_head's input [B, H]
        return DraftOutput(chain, self.attn.lm_head(out).float())

    # ---- steps without tokens, mirrored on the other TP ranks ---------------------------------------

    def idle(self) -> int:
        """An empty step (afd.dataplane.exchange.MoEExchange.idle)."""
        if self.tp.size > 1 and self.tp.is_leader:
            self.tp.send_step(IdleStep())
        return self.exchange().idle()

    def leave(self, shutdown: bool = False) -> None:
        if self.tp.size > 1 and self.tp.is_leader:
            self.tp.send_step(LeaveStep(shutdown))
        self.exchange().leave(shutdown=shutdown)


def token_ids(seqs: list[StepSeq], device: torch.device) -> torch.Tensor:
    """The sequences' tokens [T] on `device`, each one's device drafts in its placeholders: staged without a
    host sync, and the drafts never leave the device."""
    ids = to_device(torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.long), device)
    where: list[int] = []  # the placeholders' rows in ids
    drafts: list[torch.Tensor] = []
    at = 0
    for s in seqs:
        at += len(s.token_ids)
        if s.drafts is not None:
            where.extend(range(at - len(s.drafts), at))
            drafts.append(s.drafts)
    if drafts:
        ids.index_copy_(0, to_device(torch.tensor(where), device), torch.cat(drafts))
    return ids


def _layer_id(moe_layer: int | None) -> int:
    if moe_layer is None:  # the MTP module says its block is dense, yet the block returned an MoE input
        raise RuntimeError("the MTP block returned an MoE input but the module has no MoE layer id")
    return moe_layer


def follow(runner: ModelRunner) -> LeaveStep:
    """A TP rank other than the leader: runs what the leader sends, until it leaves. Returns the leave."""
    while True:
        msg = runner.tp.recv_step()
        if isinstance(msg, RunStep):
            runner.execute(msg.seqs, micro_batches=msg.micro_batches)
            runner.exchange().check()  # a passed deadline, here as on the leader (which checks after sampling)
            runner.tp.check()
        elif isinstance(msg, IdleStep):
            runner.exchange().idle()
        elif isinstance(msg, LeaveStep):
            runner.exchange().leave(shutdown=msg.shutdown)
            return msg
        else:
            raise TypeError(f"TP rank {runner.tp.rank}: unexpected message from the leader: {msg!r}")
