"""What requests' sampling parameters do to their logits before a token is drawn, in vLLM's order:
min_tokens and logit_bias, then the repetition, frequency and presence penalties.

The whole batch at once, on the logits' device. min_tokens and logit_bias become (row, token) pairs built on
the host; the penalties work on token counts [B', V] of the rows that ask for them, built from the histories
on the host and from the MTP drafts on the device (a verification row counts the drafts before it, which
the host has not read). Host values are staged without a host sync (afd.backend.base.to_device). B is the
batch, V the vocabulary.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from afd.backend.base import to_device

if TYPE_CHECKING:
    from afd.engine.sampling import SamplingParams

F32_TINY, F32_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max


class History(NamedTuple):
    prompt_ids: list[int]
    output_ids: list[int]
    drafts: torch.Tensor | None = None
    """Device tokens [d] after output_ids that count as output too: the MTP drafts a verification row
    sees before it, whose values the host does not know yet (afd.engine.speculative)."""


class _Pairs:
    """(row, token, value) triples of one parameter, gathered on the host."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.toks: list[int] = []
        self.vals: list[float] = []

    def add(self, b: int, toks, vals) -> None:
        toks = list(toks)
        self.rows += [b] * len(toks)
        self.toks += toks
        self.vals += list(vals)

    def on(self, logits: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The index (rows, tokens) [N] and values [N] on the logits' device."""
        dev = logits.device
        idx = to_device(torch.tensor([self.rows, self.toks], dtype=torch.long), dev)
        return (idx[0], idx[1]), to_device(torch.tensor(self.vals, dtype=logits.dtype), dev)


def apply_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[History], eos_ids: tuple[int, ...]
) -> torch.Tensor:
    """logits [B, V] -> a processed copy [B, V]; rows whose parameters process nothing stay as they are."""
    V = logits.shape[-1]
    out = logits.clone()
    barred, bias = _Pairs(), _Pairs()
    for b, (p, h) in enumerate(zip(params, histories)):
        # as HF's MinNewTokensLengthLogitsProcessor, for EOS and stop ids
        if len(h.output_ids) + _num(h.drafts) < p.min_tokens:
            toks = sorted({t for t in (*eos_ids, *p.stop_token_ids) if t < V})
            barred.add(b, toks, [float("-inf")] * len(toks))
        toks = [t for t in p.logit_bias if t < V]
        bias.add(b, toks, [p.logit_bias[t] for t in toks])
    if barred.rows:
        out.index_put_(*barred.on(out))
    if bias.rows:
        idx, vals = bias.on(out)
        out.index_put_(idx, vals, accumulate=True)  # a row's bias ids are distinct: += as HF's
    rep = [b for b, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:  # HF's RepetitionPenaltyLogitsProcessor, over prompt and output
        seen = _counts(out, [histories[b] for b in rep], prompt=True) > 0  # [Br, V]
        # in fp32's normal range: 1e-300 rounds to 0 and 1e300 to inf, and -inf * 0 or 0 * inf is NaN; the
        # clamped penalty keeps the limit (seen positive logits to +inf or 0, negative ones to 0 or -inf)
        pen = _column(out, [min(max(params[b].repetition_penalty, F32_TINY), F32_MAX) for b in rep])
        rows = to_device(torch.tensor(rep), out.device)
        x = out[rows]
        out[rows] = torch.where(seen, torch.where(x > 0, x / pen, x * pen), x)
    fp = [b for b, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if fp:  # OpenAI's formula, output tokens only
        n = _counts(out, [histories[b] for b in fp], prompt=False)  # [Bf, V]
        freq = _column(out, [params[b].frequency_penalty for b in fp])
        pres = _column(out, [params[b].presence_penalty for b in fp])
        rows = to_device(torch.tensor(fp), out.device)
        out[rows] -= freq * n + pres * (n > 0).to(out.dtype)
    return out


def _num(drafts: torch.Tensor | None) -> int:
    return 0 if drafts is None else len(drafts)


def _column(out: torch.Tensor, values: list[float]) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=out.dtype), out.device)[:, None]


def _counts(out: torch.Tensor, histories: Sequence[History], prompt: bool) -> torch.Tensor:
    """How often each token occurs in each history [len(histories), V] (output, drafts, and the prompt when
    asked: where only presence matters, a prompt token counts once): host tokens staged as (row, token,
    count) triples, device drafts added on the device."""
    V = out.shape[-1]
    host = _Pairs()
    for b, h in enumerate(histories):
        times = Counter(t for t in h.output_ids if t < V)
        if prompt:
            times.update(t for t in set(h.prompt_ids) if t < V)
        host.add(b, times.keys(), times.values())
    n = torch.zeros(len(histories), V, dtype=out.dtype, device=out.device)
    if host.rows:
        idx, vals = host.on(out)
        n.index_put_(idx, vals, accumulate=True)
    drafted = [(b, h.drafts) for b, h in enumerate(histories) if h.drafts is not None and len(h.drafts)]
    if drafted:
        rows = to_device(torch.tensor([b for b, d in drafted for _ in range(len(d))]), out.device)
        toks = torch.cat([d for _, d in drafted])
        n.index_put_((rows, toks), torch.ones_like(toks, dtype=out.dtype), accumulate=True)
    return n
