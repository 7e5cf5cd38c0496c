"""Offline generation on the serving engine: a batch of requests in (each with its own sampling and stop
strings: `run`), their completions out (ids, text, finish and stop reasons, logprobs); `generate` is the
ids-only form with one sampling for all.

`afd.LLM` (colocated), the attention node's offline worker (what `afd generate --attention-nodes A`
and `afd.LLM(attention_nodes=A)` start) and the benchmarks all run here, on the engine that serves
HTTP traffic (scheduler + runner + KV cache + sampler), driven step by step. The KV cache and the
scheduler's limits are sized for the job, so every prompt is prefilled in the first step and nothing
is preempted, as a static batch would run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from afd.backend.base import bind_device
from afd.engine.engine import Engine, StepStats
from afd.engine.messages import Logprob
from afd.engine.request import Request, RequestOutput
from afd.engine.sampling import SamplingParams
from afd.model.config import ModelConfig
from afd.model.progress import Progress


def validate_prompts(cfg: ModelConfig, prompts, max_tokens) -> list[int]:
    """Checks token ids and lengths; returns max_tokens as one int per prompt."""
    if not isinstance(prompts, list) or not all(isinstance(p, list) for p in prompts):
        raise ValueError("prompt_token_ids must be a list of lists of token ids")
    per = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(prompts)
    if len(per) != len(prompts):
        raise ValueError(f"max_tokens has {len(per)} entries for {len(prompts)} prompts")
    for i, (p, n) in enumerate(zip(prompts, per)):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]!r} is outside the vocabulary [0, {cfg.vocab_size})")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"max_tokens must be at least 1, got {n}.")
        if len(p) + n > cfg.max_position_embeddings:
            raise ValueError(
                f"prompt {i}: {len(p)} tokens + max_tokens {n} exceed the model's maximum "
                f"context length of {cfg.max_position_embeddings} tokens"
            )
    return per


@dataclass
class OfflineRequest:
    """One sequence of a job: its prompt, length limit, sampling and stops."""

    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    """Stop strings (they need the engine's tokenizer)."""
    ignore_eos: bool = False
    skip_special_tokens: bool = True


@dataclass
class Completion:
    """What a sequence generated: its ids (the token that stopped it kept), its text (ending before a stop
    string; empty without a tokenizer), why it ended, and its tokens' logprobs when asked."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[Logprob] | None = None


def run(
    engine: Engine,
    requests: list[OfflineRequest],
    logits_out: list | None = None,
    on_step: Callable[[StepStats], None] | None = None,
    progress: bool = False,
) -> list[Completion]:
    """Each request's completion. `logits_out`, if given, receives each request's list of per-step fp32
    logits. `progress`: a bar on a terminal, periodic lines in a log, counting requests done."""
    outputs = [Completion(logprobs=[] if r.params.logprobs is not None else None) for r in requests]
    errors: list[str] = []

    def collect(i: int) -> Callable[[RequestOutput], None]:
        def on_output(out: RequestOutput) -> None:
            c = outputs[i]
            c.token_ids.extend(out.new_token_ids)
            c.text += out.new_text
            if c.logprobs is not None and out.logprobs:
                c.logprobs.extend(out.logprobs)
            if out.finished:
                c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
            if out.error:
                errors.append(f"prompt {i}: {out.error}")

        return on_output

    reqs = [
        Request(
            str(i),
            list(r.prompt_ids),
            r.params,
            r.max_tokens,
            collect(i),
            stop=list(r.stop),
            ignore_eos=r.ignore_eos,
            skip_special_tokens=r.skip_special_tokens,
            logits=[] if logits_out is not None else None,
        )
        for i, r in enumerate(requests)
    ]
    if any(r.stop for r in reqs) and engine.tokenizer is None:
        raise ValueError("stop strings need the model's tokenizer (tokenizer.json)")
    for req in reqs:
        engine.add_request(req)
    bind_device(engine.runner.device)  # steps run in the caller's thread, maybe not the one that made the backend
    with Progress(len(reqs), "generating", "prompts", enabled=progress) as bar:
        while engine.has_unfinished():
            stats = engine.step()
            if stats is None:
                raise RuntimeError(
                    "the engine could schedule none of the unfinished requests (the KV cache is too small for them)"
                )
            if on_step is not None:
                on_step(stats)
            finished = len(reqs) - engine.num_unfinished()
            bar.update(finished - bar.done)
    if errors:
        raise RuntimeError("; ".join(errors))
    if logits_out is not None:
        logits_out.extend(r.logits for r in reqs)
    return outputs


def generate(
    engine: Engine,
    prompts: list[list[int]],
    max_tokens: list[int],
    params: SamplingParams,
    ignore_eos: bool = False,
    logits_out: list | None = None,
    on_step: Callable[[StepStats], None] | None = None,
    progress: bool = False,
) -> list[list[int]]:
    """Generated ids per prompt, every prompt sampled with `params` (an EOS token, when hit, is the last one
    kept): `run` for ids alone."""
    requests = [OfflineRequest(p, n, params, ignore_eos=ignore_eos) for p, n in zip(prompts, max_tokens)]
    return [c.token_ids for c in run(engine, requests, logits_out, on_step, progress)]
