"""A multi-process `afd.LLM`'s side of a job: completions from what the node processes return.

The offline worker of an attention node (attention_node/worker.py) takes one SamplingParams per job, knows
no stop strings, stops at the model config's EOS ids and returns token ids (and, when asked, every step's
logits). So a job's sequences are sent in groups of equal sampling, and the stops the engine applies with
a tokenizer (the tokenizer's EOS ids, stop strings) and logprobs are applied here to what came back, as
afd.engine.output_processor applies them: the sequences' tokens are the same, the nodes only may run past
where a colocated engine stops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from afd.engine import sample_ops
from afd.engine.offline import Completion, OfflineRequest
from afd.engine.sampling import SamplingParams
from afd.engine.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop


def run_on_nodes(
    requests: list[OfflineRequest],
    job: Callable[[list[list[int]], list[int], SamplingParams, bool, list | None], list[list[int]]],
    tok: Tokenizer | None,
    eos_ids: tuple[int, ...],
) -> list[Completion]:
    """The requests' completions, one node job (`job(prompts, max_tokens, params, ignore_eos, logits_out)`)
    per group of equal sampling; the steps' logits come back only where logprobs are asked for."""
    if tok is None and any(r.stop for r in requests):
        raise ValueError("stop strings need the model's tokenizer (tokenizer.json)")
    done: list[Completion | None] = [None] * len(requests)
    for group in groups(requests):
        first = requests[group[0]]
        logits: list | None = [] if first.params.logprobs is not None else None
        prompts = [requests[i].prompt_ids for i in group]
        ids = job(prompts, [requests[i].max_tokens for i in group], first.params, first.ignore_eos, logits)
        for k, i in enumerate(group):
            done[i] = complete(ids[k], requests[i], tok, eos_ids, None if logits is None else logits[k])
    return [c for c in done if c is not None]


def groups(requests: list[OfflineRequest]) -> list[list[int]]:
    """The requests' indices in groups of equal sampling (one node job each), in order of first appearance."""
    out: dict[str, list[int]] = {}
    for i, r in enumerate(requests):
        out.setdefault(repr((dataclasses.asdict(r.params), r.ignore_eos)), []).append(i)
    return list(out.values())


def complete(
    ids: list[int], req: OfflineRequest, tok: Tokenizer | None, eos_ids: tuple[int, ...], logits: list | None
) -> Completion:
    """What the engine with a tokenizer would have returned for `ids`, the tokens a node generated: the
    same per-token stops, text and stop strings as afd.engine.output_processor (EOS, stop ids, length, then
    a stop string found in the text so far), and logprobs from the steps' logits."""
    detok = IncrementalDetokenizer(tok, req.prompt_ids, req.skip_special_tokens) if tok is not None else None
    out = Completion()
    text = None
    for t in ids:
        out.token_ids.append(t)
        if not req.ignore_eos and t in eos_ids:
            out.finish_reason = "stop"
        elif t in req.params.stop_token_ids:
            out.finish_reason, out.stop_reason = "stop", t
        elif len(out.token_ids) >= req.max_tokens:
            out.finish_reason = "length"
        if detok is not None:
            detok.push(t)
            full = detok.text
            hit = find_stop(full, req.stop, 0) if req.stop and len(out.token_ids) >= req.params.min_tokens else None
            if hit is not None:
                out.finish_reason = "stop"
                out.stop_reason = next(s for s in req.stop if full.startswith(s, hit))
                text = full[:hit]
        if out.finish_reason is not None:
            break
    out.finish_reason = out.finish_reason or "length"  # the context limit
    if detok is not None:
        out.text = text if text is not None else detok.text + detok.flush()
    k = req.params.logprobs
    if k is not None and logits is not None and out.token_ids:
        rows = sample_ops.logprobs(torch.stack(logits[: len(out.token_ids)]), torch.tensor(out.token_ids), k)
        out.logprobs = [(r[0], [(int(i), v) for i, v in zip(r[1 : 1 + k], r[1 + k :])]) for r in rows.tolist()]
    return out


def _add_counters(reports: list[dict]) -> dict:
    """The attention nodes' spec-decode counters, summed (afd.engine.speculative.SpecDecodeStats.report)."""
    out = dict(reports[0])
    for r in reports[1:]:
        for key, value in r.items():
            out[key] = [a + b for a, b in zip(out[key], value)] if isinstance(value, list) else out[key] + value
    return out
