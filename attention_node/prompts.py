"""Prompts to token ids, with bounded work: text no context can hold is refused by its byte count before it is
tokenized, and what is tokenized is tokenized off the event loop with the GIL released (afd.engine.tokenizer),
so that one huge prompt stalls neither this node's engine and heartbeats nor, through the FFN node's wait for
every attention node's step, the other nodes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from afd.engine.tokenizer import Tokenizer
from attention_node.openai_protocol import ApiError, ChatMessage, Limits

T = TypeVar("T")


def check_text(text: str, tok: Tokenizer, limits: Limits, param: str) -> None:
    """400 for a text whose UTF-8 length alone shows it cannot fit the context (in vLLM's words for a prompt
    too long, which clients match on). A character is 1 to 4 bytes: the exact count only when those differ."""
    bound = tok.text_bound(limits.max_model_len)
    if bound is None or len(text) * 4 <= bound:
        return
    at_least = len(text) > bound  # then counting its bytes is needless work
    size = len(text) if at_least else len(text.encode("utf-8", "surrogatepass"))
    if size > bound:
        raise ApiError(
            400,
            f"This model's maximum context length is {limits.max_model_len} tokens. However, your "
            f"{'rendered conversation' if param == 'messages' else param} is "
            f"{'at least ' if at_least else ''}{size} bytes of UTF-8, more than that many tokens can hold "
            f"(at most {tok.max_token_bytes} bytes each: {bound} bytes). Please reduce the length of the input "
            "messages.",
            param,
        )


async def tokenize(fn: Callable[[], T], param: str) -> T:
    """Runs a tokenization (or a decode) on a worker thread; text it cannot take is the client's mistake (400)."""
    from jinja2.exceptions import TemplateError

    try:
        return await asyncio.to_thread(fn)
    except (TemplateError, ValueError, TypeError) as e:  # ValueError: UnicodeError (lone surrogates) too
        raise ApiError(400, f"The {param} could not be tokenized: {e}", param) from None


async def text_ids(tok: Tokenizer, text: str, limits: Limits, add_special_tokens: bool = True) -> list[int]:
    check_text(text, tok, limits, "prompt")
    return await tokenize(lambda: tok.encode(text, add_special_tokens), "prompt")


TEMPLATE_OWN = ("messages", "add_generation_prompt", "tools", "bos_token", "eos_token")
"""Template variables a request's chat_template_kwargs may not set: the server sets them."""


async def chat_ids(
    tok: Tokenizer,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    limits: Limits,
    *,
    add_special_tokens: bool = False,
    template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
) -> list[int]:
    """The conversation through the chat template, then tokenized. The bound is checked on the rendered text:
    a template may leave content out (e.g. an earlier turn's reasoning), so the messages' size says nothing.
    `tools` reach the template as HF's apply_chat_template hands them (OpenAI's tool objects), so that the model
    sees the functions it may call; `template_kwargs` are the request's own variables."""
    msgs = [m.for_template(tok.chat_template or "") for m in messages]
    extra = dict(template_kwargs or {})
    clash = sorted(k for k in extra if k in TEMPLATE_OWN)
    if clash:
        raise ApiError(
            400, f"chat_template_kwargs may not set {', '.join(clash)}: the server sets it.", "chat_template_kwargs"
        )
    if tools:
        extra["tools"] = tools

    def render() -> str:
        return tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, **extra)

    text = await _render(render)
    check_text(text, tok, limits, "messages")
    # the rendered template carries its own BOS: special tokens only when the request asks for them
    return await tokenize(lambda: tok.encode(text, add_special_tokens=add_special_tokens), "messages")


async def _render(fn: Callable[[], str]) -> str:
    from jinja2.exceptions import TemplateError

    try:
        return await asyncio.to_thread(fn)
    except (TemplateError, ValueError, TypeError) as e:
        raise ApiError(400, f"The messages could not be tokenized: {e}", "messages") from None


async def completion_prompts(
    tok: Tokenizer | None, prompt, limits: Limits, add_special_tokens: bool = True
) -> list[list[int]]:
    """/v1/completions' `prompt` (a text, ids, or a list of either) -> each prompt's ids."""
    items = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    out = []
    for p in items:
        if isinstance(p, str):
            if tok is None:
                raise ApiError(400, "This model has no tokenizer.json: send the prompt as token ids.", "prompt")
            out.append(await text_ids(tok, p, limits, add_special_tokens))
        else:
            out.append(p)
    return out
