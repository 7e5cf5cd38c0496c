"""MTP speculative decoding: the checkpoint's multi-token-prediction module drafts N tokens (N = 1, 2)
after each step, and the next step verifies them.

A decoding request whose last token is x_n (at position n, not yet in the KV cache) and whose drafts
are d_1 .. d_N runs [x_n, d_1, .., d_N] at positions n .. n + N, a short prefill, and gets logits at
every one of them (StepSeq.num_logits). The sampler keeps the drafts the target agrees with and adds
one token of its own (afd.engine.sampling.Sampler.verify), so a step emits 1 .. N + 1 tokens. KV written
for rejected drafts is rolled back by the scheduler (Scheduler.update): num_computed counts only the
accepted positions, and KV blocks past them are freed (the next step overwrites the slots it reuses).

Drafting (`Speculator.propose`, after the update) then runs the MTP module (afd.model.mtp) over exactly
the positions the main model computed and kept this step, from the hidden states the runner returned
with the step's logits: each position's hidden state h_t is paired with the token at t + 1 (the
prompt's, an accepted draft, or the token just sampled); that keeps the MTP block's own KV cache layer
in step with the main model's. The last position's prediction is d'_1; with N = 2 the module runs once
more at the next position on (its own hidden state, d'_1) for d'_2, in KV room the scheduler reserves.
A request gets no more drafts than it has tokens left to generate, minus one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from afd.backend.base import to_device
from afd.engine.messages import StepPlan, StepSeq
from afd.engine.request import Request, Status
from afd.engine.runner import ModelRunner
from afd.engine.scheduler import Scheduler


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py, SpecDecodingStats): exported as
    afd_spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens and
    _num_accepted_tokens_per_pos{position}. Acceptance rate = accepted / draft tokens; tokens per step of
    a drafting request (vLLM's mean acceptance length, counting the bonus token) = 1 + accepted / drafts."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for pos in range(accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    def report(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
        }


class Speculator:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, num_tokens: int):
        if runner.mtp is None:
            raise ValueError("speculative decoding needs the runner built with the checkpoint's MTP module")
        self.runner, self.scheduler, self.n = runner, scheduler, num_tokens
        self.stats = SpecDecodeStats(num_tokens)

    def propose(
        self, plan: StepPlan, sampled: Sequence[list[int] | None], hidden: torch.Tensor | None, max_model_len: int
    ) -> None:
        """After the scheduler's update of the step `plan` ran (sampled: what each entry emitted, hidden:
        the runner's hidden states of the step): counts the verified drafts, runs the MTP module over the
        positions each request kept and sets `draft` on each running request that awaits its next token.
        The drafts stay on the device: the next step runs and verifies them there, and the host learns the
        kept ones with that step's tokens, in its one read."""
        for s, toks in zip(plan, sampled):
            if s.num_drafts and toks is not None:
                self.stats.observe(s.num_drafts, len(toks) - 1)
        reqs: list[Request] = []
        seqs: list[StepSeq] = []
        rows: list[int] = []
        want: list[int] = []
        for s, q in zip(plan, plan.token_rows()):
            req, before = s.request, s.start
            if req.status is not Status.RUNNING or req.num_computed <= before:
                continue
            after = req.num_computed
            reqs.append(req)
            seqs.append(StepSeq(req.all_ids[before + 1 : after + 1], before, req.block_table))
            rows.extend(range(q, q + after - before))
            left = min(req.max_tokens - len(req.output_ids), max_model_len - req.num_tokens) - 1
            # a constrained request drafts nothing: the sampler would discard every draft the grammar did not
            # check (afd.engine.sampling); its MTP-layer KV is still written here, as for any request
            drafts = req.grammar is None and after == req.num_tokens - 1
            want.append(min(self.n, left) if drafts else 0)
        if not seqs:
            return
        if hidden is None:
            raise RuntimeError("the runner returned no hidden states to draft from")
        dev = hidden.device
        out = self.runner.mtp_step(seqs, hidden[to_device(torch.tensor(rows), dev)])
        live = [k for k, w in enumerate(want) if w > 0]
        if not live:
            return
        at = to_device(torch.tensor(live), dev)
        table = out.logits[at].argmax(dim=-1)[:, None]  # [B, 1]: each live request's first draft
        h = out.hidden[at]
        depths = [1] * len(live)
        go = list(range(len(live)))  # rows of `table` still chaining
        for depth in range(1, self.n):  # chained drafts: the MTP module one position further on
            # its KV goes at position num_computed + depth - 1 (no room: the request drafts fewer this time)
            go = [
                i
                for i in go
                if want[live[i]] > depth and self.scheduler.reserve(reqs[live[i]], reqs[live[i]].num_computed + depth)
            ]
            if not go:
                break
            idx = to_device(torch.tensor(go), dev)
            chained = [
                StepSeq([0], reqs[live[i]].num_computed + depth - 1, reqs[live[i]].block_table, drafts=table[i, -1:])
                for i in go
            ]
            out = self.runner.mtp_step(chained, h[idx])
            h = torch.zeros_like(h).index_copy_(0, idx, out.hidden)
            column = torch.zeros_like(table[:, 0]).index_copy_(0, idx, out.logits.argmax(dim=-1))
            table = torch.cat([table, column[:, None]], dim=1)
            for i in go:
                depths[i] += 1
        for i, k in enumerate(live):
            reqs[k].draft = table[i, : depths[i]]
