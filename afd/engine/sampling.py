"""Token sampling: penalties, logit bias and min_tokens (afd.engine.logits), structured outputs' grammar
mask (afd.engine.grammar), then greedy or temperature with top-k / top-p, each request with its own optional
seed; speculative decoding's verification.

A step's logits rows are sampled as one batch on their device (afd.engine.sample_ops), every sampling
field included, and the host reads the result once: each row's token (and whether its draft was kept, and
its logprobs when asked) in one tensor. That read is the attention node's one host sync of a decode step
(docs/architecture/backends.md). A constrained request's mask is computed on the host before the device ops
(the grammar's state is the host's: the tokens it has read) and staged like every other per-row value.

Speculative decoding and grammars: a constrained request's MTP drafts are never kept (its row 0 is sampled
under the mask and emits the one token), since the mask of the row after a draft depends on the draft's value,
which only the device knows until the step's read. Greedy, it emits what decoding without drafts emits;
sampled, the same distribution (a seeded one's stream differs: the discarded rows draw from its generator too)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from afd.backend import host_syncs
from afd.backend.base import to_device
from afd.engine import sample_ops as ops
from afd.engine.grammar import fill_masks
from afd.engine.logits import History, apply_penalties
from afd.engine.messages import Logprob, SampledStep

if TYPE_CHECKING:
    from afd.engine.grammar import Grammar
    from afd.engine.messages import ScheduledSeq, StepPlan

# vLLM bounds seeds to torch.long; a generator refuses what does not fit 64 bits.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20
"""Top logprobs per token a request may ask for (OpenAI's cap)."""
GREEDY_BELOW = 1e-5
"""Temperatures under this are greedy, as in vLLM: dividing logits by 1e-172 overflows to inf."""


@dataclass
class SamplingParams:
    temperature: float = 0.0
    """0 (or anything below GREEDY_BELOW) means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 means no top-k cut."""
    min_p: float = 0.0
    """vLLM's: after temperature, tokens less likely than min_p x the most likely one are dropped (0: off)."""
    seed: int | None = None
    presence_penalty: float = 0.0
    """OpenAI: subtracted from the logit of every token the output already holds (-2..2)."""
    frequency_penalty: float = 0.0
    """OpenAI: subtracted once per occurrence in the output (-2..2)."""
    repetition_penalty: float = 1.0
    """HF / vLLM: logits of tokens in prompt or output divided (if > 0) or multiplied by it (> 0)."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Token id -> added to its logit (-100..100)."""
    min_tokens: int = 0
    """EOS and stop_token_ids are barred (and stop strings not checked) until this many tokens exist."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the request (finish_reason stop, stop_reason the id); they stay in the output."""
    logprobs: int | None = None
    """Return each sampled token's logprob and this many top alternatives (None: no logprobs)."""

    def __post_init__(self):
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise ValueError(f"seed must be in [{INT64_MIN}, {INT64_MAX}], got {self.seed}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:  # NaN fails this too
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for tok, bias in self.logit_bias.items():
            if not isinstance(tok, int) or tok < 0:
                raise ValueError(f"logit_bias: token id {tok!r} must be a non-negative integer")
            if not (isinstance(bias, (int, float)) and math.isfinite(bias) and -100 <= bias <= 100):
                raise ValueError(f"logit_bias: the bias of token {tok} must be in [-100, 100], got {bias!r}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def processes_logits(self) -> bool:
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )


@dataclass(frozen=True, slots=True)
class Row:
    """One logits row to sample: a request's, with the draft token it verifies (None: no draft)."""

    params: SamplingParams
    request_id: object
    history: History
    """Prompt and output before this row's token (with drafts: the drafts before it too)."""
    draft: int | None = None
    """Where the draft this row verifies is in the batch's draft tokens (None: no draft)."""
    grammar: Grammar | None = None
    """Structured outputs: the tokens the row may emit (its draft, if any, is then never kept)."""


@dataclass(frozen=True, slots=True)
class Drawn:
    token: int
    """What the row emits: its draft when kept, else the target's own token."""
    kept: bool
    logprob: Logprob | None


class Sampler:
    """Samples batches of rows on their device; keeps one device generator per seeded request so that a seed
    reproduces its tokens across steps."""

    def __init__(self, eos_ids: tuple[int, ...] = ()):
        self.eos_ids = eos_ids
        self._generators: dict[object, torch.Generator] = {}

    def forget(self, request_id: object) -> None:
        self._generators.pop(request_id, None)

    def draw(self, logits: torch.Tensor, rows: Sequence[Row], drafts: torch.Tensor | None = None) -> list[Drawn]:
        """logits [R, V] fp32, one row each -> what each row emits, read by the host once. drafts: the draft
        tokens [D] on the device that rows' `draft` index."""
        dev, R, V = logits.device, logits.shape[0], logits.shape[1]
        params = [r.params for r in rows]
        x = logits
        if any(p.processes_logits for p in params):
            x = apply_penalties(logits, params, [r.history for r in rows], self.eos_ids)
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if constrained:  # -inf where the grammar forbids: after the penalties, which keep -inf
            mask = fill_masks([rows[i].grammar for i in constrained], V)  # type: ignore[misc]
            x = x.clone() if x is logits else x
            ops.apply_bitmask(x, to_device(torch.tensor(constrained), dev), to_device(mask, dev))
        tok = x.argmax(dim=-1)  # [R] greedy: a draft is kept iff it is the argmax
        kept = torch.zeros_like(tok, dtype=torch.bool)
        drafting = drafts is not None and any(r.draft is not None and r.grammar is None for r in rows)
        if drafting:
            assert drafts is not None
            has = to_device(torch.tensor([r.draft is not None and r.grammar is None for r in rows]), dev)
            draft = drafts[to_device(torch.tensor([r.draft or 0 for r in rows]), dev)] * has  # [R], 0 where none
            kept = has & (tok == draft)
        hot = [p.temperature >= GREEDY_BELOW for p in params]
        if any(hot):
            # a temperature past fp32's range would be inf, and inf / inf (a logit a penalty sent to inf) NaN;
            # a top_k past the vocabulary is no cut (and past int64 would not even make a tensor)
            temp = [min(p.temperature, ops.F32_MAX) if h else 1.0 for p, h in zip(params, hot)]
            rows_knobs = [temp, [p.top_p for p in params], [p.min_p for p in params]]
            knobs = to_device(torch.tensor(rows_knobs, dtype=torch.float32), dev)
            ks = [min(p.top_k, V) for p in params]
            top_k = to_device(torch.tensor(ks), dev) if any(ks) else None
            top_p = knobs[1] if any(p.top_p < 1 for p in params) else None
            min_p = knobs[2] if any(p.min_p > 0 for p in params) else None
            probs = ops.probs(x, knobs[0], top_k, max(ks), top_p, min_p)
            gens = {i: self._generator(r, dev) for i, r in enumerate(rows) if hot[i] and r.params.seed is not None}
            e = ops.noise((R, V), dev, gens)
            if drafting:
                q = torch.nn.functional.one_hot(draft, V).to(probs.dtype) * has[:, None]  # MTP drafts: argmax
                drawn, kept_hot = ops.rejection_sample(probs, q, draft, ops.uniform(R, dev, gens), e)
                kept_hot = kept_hot & has
            else:
                drawn, kept_hot = ops.draw(probs, e), kept
            is_hot = to_device(torch.tensor(hot), dev)
            tok, kept = torch.where(is_hot, drawn, tok), torch.where(is_hot, kept_hot, kept)
        return self._read(logits, tok, kept, params)

    def _read(self, logits: torch.Tensor, tok: torch.Tensor, kept: torch.Tensor, params: list[SamplingParams]):
        """The one host read: [R, 2] (token, kept), with [R, 1 + 2k] logprobs beside them when a row asks."""
        k = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        packed = torch.stack([tok, kept.long()], dim=1)
        if k is not None:
            packed = torch.cat([packed.double(), ops.logprobs(logits, tok, k)], dim=1)
        out = []
        for p, row in zip(params, host_syncs.to_list(packed)):
            lp = None
            if p.logprobs is not None and k is not None:
                ids, vals = row[3 : 3 + p.logprobs], row[3 + k : 3 + k + p.logprobs]
                lp = (row[2], [(int(i), v) for i, v in zip(ids, vals)])
            out.append(Drawn(int(row[0]), bool(row[1]), lp))
        return out

    def _generator(self, row: Row, device: torch.device) -> torch.Generator:
        gen = self._generators.get(row.request_id)
        if gen is None:
            gen = torch.Generator(device=device).manual_seed(row.params.seed)  # type: ignore[arg-type]
            self._generators[row.request_id] = gen
        return gen

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        request_ids: list,
        histories: list[History] | None = None,
    ) -> list[int]:
        """logits [B, V] fp32 -> one token id per row. `histories` (prompt and output ids per row) are
        needed when a request asks for penalties or min_tokens."""
        if histories is None:
            if any(p.processes_logits for p in params):
                raise ValueError("penalties and min_tokens need each row's history")
            histories = [History([], [])] * len(params)
        rows = [Row(p, rid, h) for p, rid, h in zip(params, request_ids, histories)]
        return [d.token for d in self.draw(logits, rows)]

    def verify(
        self, logits: torch.Tensor, drafts: Sequence[int] | torch.Tensor, p: SamplingParams, rid, history: History
    ) -> list[int]:
        """Speculative decoding: logits [d + 1, V] of a request's last token and its d draft tokens ->
        the tokens it emits: the accepted drafts, then one more (the target's correction at the first
        rejected draft, or a bonus token after the last). Row j is processed with the tokens before it
        (penalties, min_tokens). Greedy keeps a draft iff it is the argmax, so the tokens are those of
        decoding one at a time; sampling follows the rejection rule (`sample_ops.rejection_sample`), so
        their distribution is too. Drafts are the MTP head's argmax: q is one-hot at the draft."""
        d = to_device(torch.as_tensor(drafts, dtype=torch.long), logits.device)
        return [t.token for t in accepted(self.draw(logits, verify_rows(d, 0, p, rid, history), d))]


def verify_rows(drafts: torch.Tensor, first: int, p: SamplingParams, rid, h: History) -> list[Row]:
    """The rows verifying `drafts` [d] (device tokens, at `first` in the batch's draft tokens). Row j sees the
    drafts before it as output (all of them kept, or it emits nothing)."""
    n = len(drafts)
    return [
        Row(p, rid, History(h.prompt_ids, h.output_ids, drafts[:j] if j else None), first + j if j < n else None)
        for j in range(n + 1)
    ]


def accepted(drawn: list[Drawn]) -> list[Drawn]:
    """A verification's rows -> what it emits: each kept draft, then the first row that keeps none."""
    for j, d in enumerate(drawn):
        if j == len(drawn) - 1 or not d.kept:
            return drawn[: j + 1]
    return drawn


def sample_step(sampler: Sampler, plan: StepPlan, logits: torch.Tensor) -> SampledStep:
    """Per entry of the plan, the tokens its request emits (and their logprobs, when it asks): one, or with
    drafts to verify (its logits rows row .. row + d) the accepted ones and one more; None for a prefill
    chunk that samples nothing. Every row in one batch; if that raises, entry by entry, so that an entry
    whose sampling raises gets None and its error in `errors` while the others get their tokens."""
    starts = plan.logit_rows()
    due = [k for k, s in enumerate(plan.seqs) if s.samples]
    if not due:
        return SampledStep([None] * len(plan), [None] * len(plan))
    drafted = [plan.seqs[k].drafts for k in due]
    drafts = torch.cat([d for d in drafted if d is not None]) if any(d is not None for d in drafted) else None
    rows, at = {}, 0
    for k in due:
        rows[k], at = _rows(plan.seqs[k], at), at + plan.seqs[k].num_drafts
    out: dict[int, list[Drawn]] = {}
    errors: dict[int, Exception] = {}
    try:
        flat = sampler.draw(
            _take_rows(logits, [starts[k] + j for k in due for j in range(len(rows[k]))]),
            [r for k in due for r in rows[k]],
            drafts,
        )
        for k in due:
            out[k], flat = accepted(flat[: len(rows[k])]), flat[len(rows[k]) :]
    except Exception:
        for k in due:
            try:
                out[k] = accepted(sampler.draw(logits[starts[k] : starts[k] + len(rows[k])], rows[k], drafts))
            except Exception as e:
                errors[k] = e
    tokens: list[list[int] | None] = [None] * len(plan)
    logprobs: list[list[Logprob] | None] = [None] * len(plan)
    for k, drawn in out.items():
        tokens[k] = [d.token for d in drawn]
        if plan.seqs[k].request.params.logprobs is not None:
            logprobs[k] = [d.logprob for d in drawn if d.logprob is not None]
    return SampledStep(tokens, logprobs, errors)


def _rows(s: ScheduledSeq, first: int) -> list[Row]:
    """The rows an entry samples; its drafts are at `first` in the step's draft tokens."""
    req, h = s.request, History(s.request.prompt_ids, s.request.output_ids)
    if s.drafts is None:
        return [Row(req.params, req.request_id, h, grammar=req.grammar)]
    rows = verify_rows(s.drafts, first, req.params, req.request_id, h)
    if req.grammar is not None:  # row 0 under the mask keeps no draft, so the rows after it emit nothing
        rows[0] = Row(req.params, req.request_id, h, rows[0].draft, req.grammar)
    return rows


def _take_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows]: a slice where the rows are consecutive (the usual case), else a gather whose index is
    staged without a host sync (a list index is a blocking copy)."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return logits[rows[0] : rows[0] + len(rows)]
    return logits[to_device(torch.tensor(rows), logits.device)]
