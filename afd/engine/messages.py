"""What the engine's parts hand each other: small records, never bare tuples.

One step: the scheduler's `StepPlan` (each request, the tokens it computes and the drafts among them)
-> the runner's `RunnerOutput` (logits, and the hidden states the MTP module drafts from) -> the
sampler's `SampledStep` (tokens, logprobs) -> the output processor. Between threads: the engine's inbox
items (`AddRequest`, `AbortRequest`). Between processes: what the TP leader broadcasts to its other ranks
(`RunStep`, `IdleStep`, `LeaveStep`; pickled, so plain frozen dataclasses). And what a step did (`StepStats`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from afd.dataplane.exchange import ExchangeStats

if TYPE_CHECKING:  # request.py imports the sampler, which hands back a SampledStep
    from afd.engine.request import Request


@dataclass
class StepSeq:
    """One sequence's share of a step, as the runner sees it: new tokens appended after `start` cached ones."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    num_logits: int = 1
    """Logits rows the step returns for it: of its last token, or of its last 1 + d when it verifies d
    draft tokens (speculative decoding)."""
    drafts: torch.Tensor | None = None
    """Device tokens [d] that stand in for the last d of `token_ids` (placeholders there): MTP drafts stay
    on the device, so the host never waits to read them (afd.engine.speculative)."""


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One request in the scheduler's plan."""

    request: Request
    start: int
    """Tokens of the request cached before the step (its num_computed when scheduled)."""
    num_tokens: int
    """Tokens the step computes for it: uncached ones, then its drafts."""
    num_drafts: int
    """How many drafts the step verifies: the last num_drafts of those tokens (the scheduler decides how
    many fit; nobody else works it out again)."""
    samples: bool
    """The step reaches the request's last token, so a token is due (else it is one chunk of a prefill)."""
    drafts: torch.Tensor | None = None
    """Those drafts' tokens [num_drafts] on the device (None without drafts); the host learns the kept
    ones from the step's sampled tokens."""

    @property
    def num_logits(self) -> int:
        return self.num_drafts + 1

    def step_seq(self) -> StepSeq:
        req, n = self.request, self.num_tokens - self.num_drafts
        ids = req.all_ids[self.start : self.start + n] + [0] * self.num_drafts
        return StepSeq(ids, self.start, req.block_table, self.num_logits, self.drafts)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the next step runs, in order (the runner's sequence order, the logits' row order)."""

    seqs: tuple[ScheduledSeq, ...] = ()

    def __iter__(self) -> Iterator[ScheduledSeq]:
        return iter(self.seqs)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    def step_seqs(self) -> list[StepSeq]:
        return [s.step_seq() for s in self.seqs]

    def logit_rows(self) -> list[int]:
        """Each sequence's first row in the step's logits."""
        return _starts(s.num_logits for s in self.seqs)

    def token_rows(self) -> list[int]:
        """Each sequence's first row in the step's tokens (and so in RunnerOutput.hidden)."""
        return _starts(s.num_tokens for s in self.seqs)


def _starts(sizes) -> list[int]:
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += n
    return out


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    logits: torch.Tensor
    """fp32 [sum of num_logits, V]: each sequence's last token's, or with d drafts its last 1 + d tokens'."""
    hidden: torch.Tensor | None
    """With an MTP module: every token's final hidden state [T, H] in the step's token order (the
    drafts' input); else None."""
    micro_batches: int
    """What the step ran with (afd_micro_batches): the tuner may choose anew right after it."""
    exchange: ExchangeStats
    """What the step's MoE exchange did."""


Logprob = tuple[float, list[tuple[int, float]]]
"""A token's logprob and the top alternatives' (id, logprob), most likely first."""


@dataclass(frozen=True, slots=True)
class SampledStep:
    """The sampler's answer for one step (afd.engine.sampling.sample_step), per plan entry."""

    tokens: list[list[int] | None]
    """The tokens the entry's request emits; None for a prefill chunk that samples nothing, or a request
    whose sampling failed."""
    logprobs: list[list[Logprob] | None]
    """Per emitted token, when the request asks for logprobs; else None."""
    errors: dict[int, Exception] = field(default_factory=dict)
    """Plan entry -> why its request's sampling raised: that request fails alone (its tokens are None)."""


@dataclass(frozen=True)
class StepStats:
    """What one forward step did (metrics and benchmarks read it)."""

    num_tokens: int
    seconds: float
    ffn_wait: float
    """Seconds the step was blocked waiting for MoE outputs: the exchange that was not hidden."""
    a2f_bytes: int
    phase: str
    """prefill, decode or mixed."""
    generated: int = 0
    """Tokens the step emitted (up to N + 1 per decoding request with N speculative tokens)."""
    draft_seconds: float = 0.0
    """Seconds the MTP module took to draft the next step's tokens (speculative decoding)."""

    def report(self) -> dict:
        """The per-step record offline jobs write (afd.bench reads it)."""
        return {
            "tokens": self.num_tokens,
            "seconds": self.seconds,
            "ffn_wait": self.ffn_wait,
            "generated": self.generated,
            "draft_seconds": self.draft_seconds,
        }


@dataclass(frozen=True, slots=True)
class DraftOutput:
    """The MTP module's forward at each sequence's last position."""

    hidden: torch.Tensor
    """Its own hidden state [B, H] (DeepSeek-V4: its mHC streams [B, N, H]): the next chained draft's input."""
    logits: torch.Tensor
    """fp32 [B, V] of the token after next."""


# ---- the engine's inbox (other threads -> the engine thread) -------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequest:
    request: Request


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


# ---- the TP leader's broadcast (rank 0 -> the other ranks of its attention node) --------------------------


@dataclass(frozen=True)
class RunStep:
    seqs: list[StepSeq]
    micro_batches: int
    """The leader's choice (each rank's tuner would measure its own times)."""


@dataclass(frozen=True)
class IdleStep:
    pass


@dataclass(frozen=True)
class LeaveStep:
    shutdown: bool = False


@dataclass(frozen=True)
class RunJob:
    """An offline job's prompts (the offline worker): every rank sizes the job's engine from them alike."""

    prompts: list[list[int]]
    max_tokens: list[int]


TPMessage = RunStep | IdleStep | LeaveStep | RunJob
