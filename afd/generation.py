"""Static-batch generation over a ModelRunner: prefill every prompt, then decode until each ends.

The offline reference loop (`afd.LLM`, `afd generate`). The serving engine schedules continuously.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from afd.kv_cache import KVCache
from afd.runner import ModelRunner, StepSeq
from afd.sampling import Sampler, SamplingParams


@dataclass
class _Seq:
    idx: int
    tokens: list[int]
    prompt_len: int
    max_tokens: int
    table: list[int] = field(default_factory=list)
    computed: int = 0

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len:]


def generate(runner: ModelRunner, kv: KVCache, prompts: list[list[int]], max_tokens: list[int],
             params: SamplingParams, eos_ids: tuple[int, ...] = (), ignore_eos: bool = False,
             logits_out: list[list[torch.Tensor]] | None = None,
             on_step: Callable[[int, float], None] | None = None) -> list[list[int]]:
    """Generated token ids per prompt (an EOS token, when hit, is the last one kept).

    on_step(num_tokens, seconds) is called after every forward step (for benchmarks)."""
    seqs = [_Seq(i, list(p), len(p), n) for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    if logits_out is not None:
        logits_out.extend([] for _ in prompts)
    sampler = Sampler()
    active = [s for s in seqs if s.max_tokens > 0]
    while active:
        for s in active:
            kv.grow(s.table, len(s.tokens))
        batch = [StepSeq(s.tokens[s.computed:], s.computed, s.table) for s in active]
        t0 = time.perf_counter()
        logits = runner.execute(batch)
        if on_step is not None:
            on_step(sum(len(b.token_ids) for b in batch), time.perf_counter() - t0)
        next_ids = sampler.sample(logits, [params] * len(active), [s.idx for s in active])
        still = []
        for s, tok, row in zip(active, next_ids, logits):
            s.computed = len(s.tokens)
            s.tokens.append(tok)
            if logits_out is not None:
                logits_out[s.idx].append(row.clone())
            done = len(s.output) >= s.max_tokens or (not ignore_eos and tok in eos_ids)
            if done:
                kv.allocator.free(s.table)
                s.table = []
            else:
                still.append(s)
        active = still
    return [s.output for s in seqs]
