"""What requests' sampling parameters do to their logits before a token is drawn, in vLLM's order:
min_tokens and logit_bias, then the repetition, frequency and presence penalties.

The whole batch at once, on the logits' device: each parameter becomes a list of (row, token) pairs built
on the host from the rows' histories, staged to the device without a host sync (afd.backend.base.to_device),
and applied with one indexed op. B is the batch, V the vocabulary.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from afd.backend.base import to_device

if TYPE_CHECKING:
    from afd.engine.sampling import SamplingParams


class History(NamedTuple):
    prompt_ids: list[int]
    output_ids: list[int]


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
    barred, bias, rep, count = _Pairs(), _Pairs(), _Pairs(), _Pairs()
    freq: list[float] = []
    pres: list[float] = []
    for b, (p, h) in enumerate(zip(params, histories)):
        if len(h.output_ids) < p.min_tokens:  # as HF's MinNewTokensLengthLogitsProcessor, for EOS and stop ids
            toks = sorted({t for t in (*eos_ids, *p.stop_token_ids) if t < V})
            barred.add(b, toks, [float("-inf")] * len(toks))
        toks = [t for t in p.logit_bias if t < V]
        bias.add(b, toks, [p.logit_bias[t] for t in toks])
        if p.repetition_penalty != 1.0:  # HF's RepetitionPenaltyLogitsProcessor, over prompt and output
            seen = sorted(t for t in set(h.prompt_ids) | set(h.output_ids) if t < V)
            rep.add(b, seen, [p.repetition_penalty] * len(seen))
        if (p.frequency_penalty or p.presence_penalty) and h.output_ids:  # OpenAI's formula, output tokens only
            times = Counter(t for t in h.output_ids if t < V)
            count.add(b, times.keys(), times.values())
            freq += [p.frequency_penalty] * len(times)
            pres += [p.presence_penalty] * len(times)
    if barred.rows:
        out.index_put_(*barred.on(out))
    if bias.rows:
        idx, vals = bias.on(out)
        out.index_put_(idx, vals, accumulate=True)  # a row's bias ids are distinct: += as HF's
    if rep.rows:
        idx, pen = rep.on(out)
        vals = out[idx]
        out.index_put_(idx, torch.where(vals > 0, vals / pen, vals * pen))
    if count.rows:
        idx, n = count.on(out)
        fp = to_device(torch.tensor([freq, pres], dtype=out.dtype), out.device)
        out.index_put_(idx, -(fp[0] * n + fp[1] * (n > 0).to(out.dtype)), accumulate=True)
    return out
