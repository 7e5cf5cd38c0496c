"""MTP speculative decoding: the checkpoint's multi-token-prediction module drafts N tokens (N = 1, 2)
after each step, and the next step verifies them.

A decoding request whose last token is x_n (at position n, not yet in the KV cache) and whose drafts
are d_1 .. d_N runs [x_n, d_1, .., d_N] at positions n .. n + N, a short prefill, and gets logits at
every one of them (StepSeq.num_logits). The sampler keeps the drafts the target agrees with and adds
one token of its own (afd.engine.sampling.Sampler.verify), so a step emits 1 .. N + 1 tokens. KV written
for rejected drafts is rolled back: num_computed counts only the accepted positions, and KV blocks past
them are freed (the next step overwrites the slots it reuses).

Drafting (`Speculator.propose`) then runs the MTP module (afd.model.mtp) over exactly the positions the
main model computed and kept this step, pairing each position's hidden state h_t with the token at
t + 1 (the prompt's, an accepted draft, or the token just sampled); that keeps the MTP block's own KV
cache layer in step with the main model's. The last position's prediction is d'_1; with N = 2 the module
runs once more at the next position on (its own hidden state, d'_1) for d'_2. A request gets no more
drafts than it has tokens left to generate, minus one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from afd.engine.kv_cache import OutOfBlocks, blocks_needed
from afd.engine.request import Request, Status
from afd.engine.runner import ModelRunner, StepSeq


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

    def __post_init__(self):
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


def step_seq(req: Request, n: int) -> StepSeq:
    """The step's share of a request scheduled for n tokens: its uncached tokens, then drafts (as many
    as fit in n), with logits for its last token and each draft."""
    drafts = max(0, req.num_computed + n - req.num_tokens)
    ids = req.all_ids + req.draft[:drafts]
    return StepSeq(ids[req.num_computed : req.num_computed + n], req.num_computed, req.block_table, drafts + 1)


class Speculator:
    def __init__(self, runner: ModelRunner, num_tokens: int):
        if runner.mtp is None:
            raise ValueError("speculative decoding needs the runner built with the checkpoint's MTP module")
        self.runner, self.n = runner, num_tokens
        self.stats = SpecDecodeStats(num_tokens)

    def propose(self, advanced: list[tuple[Request, int, int]], max_model_len: int) -> None:
        """advanced: (request, tokens it had cached before the step, its first row in the step) of every
        request the step ran. Rolls their KV back to the accepted positions, runs the MTP module over
        those positions and sets `draft` on each running request that awaits its next token."""
        bs = self.runner.kv.block_size
        reqs, seqs, rows, want = [], [], [], []
        for req, before, q in advanced:
            if req.status is not Status.RUNNING or req.num_computed <= before:
                continue
            after = req.num_computed
            keep = blocks_needed(after, bs)  # roll back: blocks that held only rejected drafts go back
            self.runner.kv.allocator.free(req.block_table[keep:])
            del req.block_table[keep:]
            reqs.append(req)
            seqs.append(StepSeq(req.all_ids[before + 1 : after + 1], before, req.block_table))
            rows.extend(range(q, q + after - before))
            left = min(req.max_tokens - len(req.output_ids), max_model_len - req.num_tokens) - 1
            want.append(min(self.n, left) if after == req.num_tokens - 1 else 0)
        if not seqs:
            return
        h, logits = self.runner.mtp_step(seqs, self.runner.last_hidden[rows])
        live = [k for k, w in enumerate(want) if w > 0]
        for k, tok in zip(live, logits[live].argmax(dim=-1).tolist()):
            reqs[k].draft = [tok]
        h = h[live]
        for depth in range(1, self.n):  # chained drafts: the MTP module one position further on
            go = [i for i, k in enumerate(live) if want[k] > depth and self._grow(reqs[k], depth)]
            if not go:
                return
            live = [live[i] for i in go]
            chained = [
                StepSeq([reqs[k].draft[-1]], reqs[k].num_computed + depth - 1, reqs[k].block_table) for k in live
            ]
            h, logits = self.runner.mtp_step(chained, h[go])
            for k, tok in zip(live, logits.argmax(dim=-1).tolist()):
                reqs[k].draft.append(tok)

    def _grow(self, req: Request, depth: int) -> bool:
        """Room in the block table for the MTP KV of position num_computed + depth - 1 (no blocks: the
        request drafts fewer tokens this time)."""
        try:
            self.runner.kv.grow(req.block_table, req.num_computed + depth)
            return True
        except OutOfBlocks:
            return False
