"""What a request's sampling parameters do to its logits before a token is drawn, in vLLM's order:
min_tokens and logit_bias, then the repetition, frequency and presence penalties.

V is the vocabulary; each function takes and returns one request's logits row [V].
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from afd.engine.sampling import SamplingParams


class History(NamedTuple):
    prompt_ids: list[int]
    output_ids: list[int]


def process(row: torch.Tensor, p: SamplingParams, h: History, eos_ids: tuple[int, ...]) -> torch.Tensor:
    row = row.clone()
    V = row.shape[-1]
    if len(h.output_ids) < p.min_tokens:  # as HF's MinNewTokensLengthLogitsProcessor, for EOS and stop ids
        barred = [t for t in (*eos_ids, *p.stop_token_ids) if t < V]
        row[barred] = float("-inf")
    for tok, bias in p.logit_bias.items():
        if tok < V:
            row[tok] += bias
    if p.repetition_penalty != 1.0:  # HF's RepetitionPenaltyLogitsProcessor, over prompt and output
        seen = torch.tensor(sorted(set(h.prompt_ids) | set(h.output_ids)), dtype=torch.long, device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and h.output_ids:  # OpenAI's formula, output tokens only
        counts = torch.bincount(torch.tensor(h.output_ids, device=row.device), minlength=V)[:V].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return row
