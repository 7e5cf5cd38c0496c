"""OpenAI / vLLM request bodies, their checks, and error bodies worded as vLLM words them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from afd.engine.sampling import INT64_MAX, INT64_MIN, SamplingParams
from attention_node.body_check import bounds_error


class ApiError(Exception):
    """Becomes {"error": {"message", "type", "param", "code"}} with HTTP status `code`."""

    TYPES = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }

    def __init__(self, code: int, message: str, param: str | None = None, type_: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param
        self.type = type_ or self.TYPES.get(code, "BadRequestError")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


MAX_N = 128
"""Choices per prompt: each is a sequence in the engine, so n is bounded like the batch."""


class _Sampling(BaseModel):
    """The fields afd implements; every other field of vLLM's models is accepted, refused or counted by
    attention_node.request_fields (extra="allow": vLLM's models allow extra fields too)."""

    # Non-finite floats are refused at validation, as vLLM does (JSON parsers accept NaN and Infinity).
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    n: int = 1
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool | None = True
    """False: the text shows special tokens too (vLLM's field; null is its default, true)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = False
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    truncation_side: Literal["left", "right"] | None = None
    request_id: str | None = None
    # structured outputs: attention_node/structured.py reads them (and vLLM's older guided_* names, which vLLM
    # 0.33's models no longer declare, from the extra fields)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    add_special_tokens: bool = True
    """A text prompt tokenized with the tokenizer's special tokens (BOS), as vLLM's default."""
    echo: bool = False
    logprobs: int | None = None
    """Top logprobs per generated token (OpenAI's legacy completions shape)."""

    def num_logprobs(self) -> int | None:
        if self.logprobs is not None and self.echo:
            raise ApiError(400, "logprobs together with echo (prompt logprobs) are not supported.", "logprobs")
        return self.logprobs


ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None

    def for_template(self, template_roles: str) -> dict:
        """The message as chat templates take it: content parts joined into text, and OpenAI's
        `developer` role as `system` when the template does not know it."""
        if self.role not in ROLES:
            raise ApiError(
                400, f"Unknown chat role {self.role!r}; expected one of {', '.join(ROLES)}.", "messages.role"
            )
        msg = self.model_dump(exclude_none=True)
        if self.role == "developer" and "developer" not in template_roles:
            msg["role"] = "system"
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(
                        400,
                        f"Content parts of type {part.get('type')!r} are not supported; "
                        'send {"type": "text", "text": ...} parts.',
                        "messages.content",
                    )
                texts.append(part["text"])
            msg["content"] = "\n".join(texts)
        return msg


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    echo: bool = False
    """The last message's content first, when it has the response's role (vLLM's)."""
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_special_tokens: bool = False
    """Special tokens added when the rendered conversation is tokenized; off, as vLLM's: the template writes them."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (say Qwen3's enable_thinking), as vLLM passes them."""

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true.", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


@dataclass
class Limits:
    max_model_len: int
    vocab_size: int


def check_prompt(ids: list[int], limits: Limits, param: str = "prompt") -> None:
    """Length first: a list no context can hold is refused without a pass over its ids."""
    if not ids:
        raise ApiError(400, "The prompt is empty: give at least one token.", param)
    n = len(ids)
    if n >= limits.max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {limits.max_model_len} tokens. However, "
            f"your request has {n} input tokens. Please reduce the length of the input messages.",
            "input_tokens",
        )
    check_ids(ids, limits, param)


def check_ids(ids: list[int], limits: Limits, param: str) -> None:
    if ids and (min(ids) < 0 or max(ids) >= limits.vocab_size):  # min/max: one pass in C, not a Python loop
        bad = next(t for t in ids if not 0 <= t < limits.vocab_size)
        raise ApiError(400, f"Token id {bad} is out of vocabulary (vocabulary size {limits.vocab_size}).", param)


COMPLETION_MAX_TOKENS = 16
"""/v1/completions without max_tokens generates this many, as vLLM and OpenAI do; chat takes the room left."""


def resolve_max_tokens(requested: int | None, n_prompt: int, limits: Limits, default: int | None = None) -> int:
    room = limits.max_model_len - n_prompt
    if requested is None:
        return room if default is None else min(default, room)
    if requested < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {requested}.", "max_tokens")
    if requested > room:
        raise ApiError(
            400,
            f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's "
            f"maximum context length is {limits.max_model_len} tokens and your request has "
            f"{n_prompt} input tokens ({requested} > {limits.max_model_len} - {n_prompt}).",
            "max_tokens",
        )
    return requested


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest, choice: int, limits: Limits | None = None
) -> SamplingParams:
    """Choice i of n draws with seed + i, so n > 1 gives different samples yet stays reproducible."""
    if req.n < 1:
        raise ApiError(400, f"n must be at least 1, got {req.n}.", "n")
    if req.n > MAX_N:
        raise ApiError(400, f"n must be at most {MAX_N}, got {req.n}.", "n")
    if req.best_of not in (None, req.n):
        raise ApiError(400, f"best_of ({req.best_of}) other than n is not supported by this server.", "best_of")
    vocab = limits.vocab_size if limits else None
    if limits is not None:
        lists = {"logit_bias": req.logit_bias, "stop_token_ids": req.stop_token_ids, "stop": req.stop}
        bad = bounds_error(lists, limits.max_model_len, limits.vocab_size)
        if bad is not None:
            raise ApiError(400, *bad)
    bias = _token_map(req.logit_bias or {}, vocab)
    stop_ids = list(req.stop_token_ids or [])
    bad_ids = [t for t in stop_ids if vocab is not None and not 0 <= t < vocab]
    if bad_ids:
        raise ApiError(
            400,
            f"stop_token_ids: token id {bad_ids[0]} is out of vocabulary (vocabulary size {vocab}).",
            "stop_token_ids",
        )
    temperature = 1.0 if req.temperature is None else req.temperature
    try:
        return SamplingParams(
            temperature=temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k in (None, -1) else req.top_k,  # -1: vLLM's "off"
            min_p=req.min_p or 0.0,
            seed=None if req.seed is None else req.seed + choice,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=bias,
            min_tokens=req.min_tokens,
            stop_token_ids=tuple(stop_ids),
            logprobs=req.num_logprobs(),
        )
    except ValueError as e:
        raise ApiError(400, str(e), str(e).split()[0].rstrip(":")) from None


def _token_map(bias: dict[str, float], vocab: int | None) -> dict[int, float]:
    """logit_bias keys arrive as JSON strings of token ids."""
    out = {}
    for key, value in bias.items():
        if not key.lstrip("-").isdigit():
            raise ApiError(400, f"logit_bias: {key!r} is not a token id.", "logit_bias")
        tok = int(key)
        if vocab is not None and not 0 <= tok < vocab:
            raise ApiError(
                400, f"logit_bias: token id {tok} is out of vocabulary (vocabulary size {vocab}).", "logit_bias"
            )
        out[tok] = value
    return out


def stop_strings(req: _Sampling) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


def validation_error(errors: list[dict]) -> ApiError:
    """FastAPI/pydantic body errors -> vLLM's 400 'Bad Request' with param like body.prompt."""
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ())]
    # pydantic reports one error per union member (prompt.str, prompt.list[int], ...): keep the field path
    field_path = [x for x in loc if not any(c in x for c in "[]") and not x.isdigit()][:2]
    param = ".".join(field_path) or None
    if first.get("type") == "json_invalid":
        return ApiError(400, f"Malformed JSON body: {first.get('msg', 'invalid JSON')}", "body", "Bad Request")
    msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}" for e in errors[:3])
    return ApiError(400, msg or "Invalid request body", param, "Bad Request")


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
