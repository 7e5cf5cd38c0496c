"""A request as the engine sees it, and what it hands back after each step."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

from afd.engine.grammar import Grammar
from afd.engine.sampling import SamplingParams
from afd.engine.tokenizer import IncrementalDetokenizer


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """The delta since the last output of one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None
    """stop, length or abort."""
    stop_reason: str | int | None = None
    """The stop string or EOS token id that ended it."""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    """Set when the engine failed the request (e.g. a dead FFN node)."""
    error_code: int = 503
    """HTTP status of `error`: 503 when the cluster cannot serve, 500 when this request alone failed."""
    logprobs: list | None = None
    """Per new token, (its logprob, [(id, logprob) of the top alternatives]) when the request asked."""


@dataclass(eq=False)  # one request is one object: the scheduler's `in` and remove() compare by identity
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    on_output: Callable[[RequestOutput], None]
    """Called from the engine thread with each delta (the API layer hands it to its event loop)."""
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    """The text leaves special tokens out (vLLM's default); the token ids keep them either way."""
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    """Tokens of prompt + output whose KV is in the cache."""
    block_table: list[int] = field(default_factory=list)
    first_scheduled: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    detok: IncrementalDetokenizer | None = None
    """Set when the model has a tokenizer."""
    text_sent: int = 0
    """Characters of the detokenized output already handed out (held back while a stop string may form)."""
    logits: list | None = None
    """When a list, each sampled step's fp32 logits row is appended (offline parity checks)."""
    draft: torch.Tensor | None = None
    """Speculative decoding: the tokens [d] the MTP module proposed to follow the last one, which the next
    step runs with it and verifies (afd.engine.speculative). They stay on the device: the host learns the
    kept ones with the next step's sampled tokens."""
    grammar: Grammar | None = None
    """Structured outputs: the grammar its tokens follow, compiled before the request came (afd.engine.grammar);
    the sampler masks its logits with it and the output processor advances it and ends the request with it."""

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens the next step may run: those whose KV is not cached yet, then the drafts to verify."""
        return self.num_tokens + self.num_drafts - self.num_computed

    @property
    def num_drafts(self) -> int:
        return 0 if self.draft is None else len(self.draft)
