"""OpenAI / vLLM request bodies, their checks, and error bodies worded as vLLM words them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from afd.engine.sampling import SamplingParams


class ApiError(Exception):
    """Becomes {"error": {"message", "type", "param", "code"}} with HTTP status `code`."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, code: int, message: str, param: str | None = None, type_: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param
        self.type = type_ or self.TYPES.get(code, "BadRequestError")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    logprobs: Any = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True


@dataclass
class Limits:
    max_model_len: int
    vocab_size: int


def check_prompt(ids: list[int], limits: Limits, param: str = "prompt") -> None:
    if not ids:
        raise ApiError(400, "The prompt is empty: give at least one token.", param)
    for t in ids:
        if not 0 <= t < limits.vocab_size:
            raise ApiError(400, f"Token id {t} is out of vocabulary (vocabulary size {limits.vocab_size}).", param)
    n = len(ids)
    if n >= limits.max_model_len:
        raise ApiError(400, f"This model's maximum context length is {limits.max_model_len} tokens. However, "
                            f"your request has {n} input tokens. Please reduce the length of the input messages.",
                       "input_tokens")


def resolve_max_tokens(requested: int | None, n_prompt: int, limits: Limits) -> int:
    room = limits.max_model_len - n_prompt
    if requested is None:
        return room
    if requested < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {requested}.", "max_tokens")
    if requested > room:
        raise ApiError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's "
                            f"maximum context length is {limits.max_model_len} tokens and your request has "
                            f"{n_prompt} input tokens ({requested} > {limits.max_model_len} - {n_prompt}).",
                       "max_tokens")
    return requested


def sampling_params(req: _Sampling, choice: int) -> SamplingParams:
    """Choice i of n draws with seed + i, so n > 1 gives different samples yet stays reproducible."""
    if req.n < 1:
        raise ApiError(400, f"n must be at least 1, got {req.n}.", "n")
    if req.logprobs not in (None, False):
        raise ApiError(400, "logprobs are not supported by this server.", "logprobs")
    temperature = 1.0 if req.temperature is None else req.temperature
    try:
        return SamplingParams(temperature=temperature, top_p=1.0 if req.top_p is None else req.top_p,
                              top_k=0 if req.top_k in (None, -1) else req.top_k,  # -1: vLLM's "off"
                              seed=None if req.seed is None else req.seed + choice)
    except ValueError as e:
        raise ApiError(400, str(e), str(e).split()[0]) from None


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
