"""What `afd.LLM.generate()` and `chat()` return, shaped as vLLM's outputs (vllm/outputs.py: RequestOutput,
CompletionOutput; vllm/logprobs.py: Logprob; read, not copied), so that code reading vLLM's results reads
afd's."""

from __future__ import annotations

from dataclasses import dataclass, field

from afd.engine.offline import Completion
from afd.engine.tokenizer import Tokenizer


@dataclass
class Logprob:
    """One token's log-probability under the model's raw distribution (before penalties and temperature,
    vLLM's default)."""

    logprob: float
    rank: int | None = None
    """1 for the most likely token. The sampled token's rank is known when it is among the top `logprobs`
    alternatives (always, greedy without penalties), else None: the engine returns no more of the
    distribution."""
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a prompt, as vLLM's `CompletionOutput`."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    """The sum of the tokens' logprobs; None unless logprobs were asked for."""
    logprobs: list[dict[int, Logprob]] | None
    """Per generated token: token id -> Logprob, the sampled token and the top `logprobs` alternatives."""
    finish_reason: str | None = None
    """"stop" (EOS, a stop token id or a stop string) or "length" (max_tokens or the context limit)."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended it; None for EOS or length."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's result, as vLLM's `RequestOutput`: `outputs` holds its n sequences."""

    request_id: str
    prompt: str | None
    """The prompt's text (a chat's rendered template); None when it was given as token ids."""
    prompt_token_ids: list[int]
    prompt_logprobs: None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    """Offline outputs are final."""


GenerateOutput = RequestOutput
"""The name afd.LLM's outputs had before they were vLLM's."""


def completion_output(index: int, c: Completion, tok: Tokenizer | None, detokenize: bool) -> CompletionOutput:
    """An offline job's completion (afd.engine.offline.Completion) as vLLM's CompletionOutput."""
    lps = None if c.logprobs is None else [_logprobs(t, lp, tok) for t, lp in zip(c.token_ids, c.logprobs)]
    cumulative = None if c.logprobs is None else sum(lp for lp, _ in c.logprobs)
    text = c.text if detokenize else ""
    return CompletionOutput(index, text, c.token_ids, cumulative, lps, c.finish_reason, c.stop_reason)


def _logprobs(token: int, lp: tuple[float, list[tuple[int, float]]], tok: Tokenizer | None) -> dict[int, Logprob]:
    """The engine's (logprob, [(id, logprob) of the top k]) of one token -> {id: Logprob} (sampled first)."""
    own, top = lp
    rank = next((r for r, (i, _) in enumerate(top, 1) if i == token), None)
    out = {token: Logprob(own, rank, _decoded(token, tok))}
    for r, (i, v) in enumerate(top, 1):
        out.setdefault(i, Logprob(v, r, _decoded(i, tok)))
    return out


def _decoded(token: int, tok: Tokenizer | None) -> str | None:
    return None if tok is None else tok.decode([token], skip_special_tokens=False)
