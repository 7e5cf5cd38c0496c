"""Response bodies and SSE streams for completions and chat completions, in OpenAI / vLLM shape; a chat answer
constrained to a tool call (attention_node/structured.py) comes back as OpenAI `tool_calls`, as vLLM returns it
(vllm/entrypoints/openai/serving_chat.py): content "", finish_reason "tool_calls" for tool_choice "required" and
"stop" for a named function."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from attention_node import structured
from attention_node.openai_protocol import ApiError


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _head(st, chat: bool, rid: str | None = None) -> dict:
    """The response's id is the request's (vLLM's cmpl-ID / chatcmpl-ID: X-Request-Id, else the body's
    request_id, else a new one), the id its log line names."""
    kind = ("chatcmpl-", "chat.completion") if chat else ("cmpl-", "text_completion")
    return {
        "id": rid or kind[0] + uuid.uuid4().hex,
        "object": kind[1],
        "created": int(time.time()),
        "model": st.model_name,
    }


def _usage(gens, completion_tokens: int) -> dict:
    prompt = sum(len(g.prompt_ids) for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


def _prompt_of(gens, n: int, i: int) -> list[int]:
    return gens[i // n].prompt_ids


def _echo(st, body, gens, i: int) -> str:
    """The prompt's text, for `echo: true` on completions ("" for chat or without a tokenizer)."""
    if not getattr(body, "echo", False) or st.tokenizer is None:
        return ""
    return st.tokenizer.decode(_prompt_of(gens, body.n, i))


def _token_text(st, tok: int) -> str:
    return st.tokenizer.decode([tok]) if st.tokenizer is not None else f"token_id:{tok}"


def _logprobs(st, toks: list[int], entries: list, chat: bool, offset: int = 0) -> dict:
    """OpenAI's logprobs object: chat's `content` list, or completions' parallel lists."""
    if chat:

        def one(tok, lp):
            text = _token_text(st, tok)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return {
            "content": [
                {**one(tok, lp), "top_logprobs": [one(a, alp) for a, alp in alts]}
                for tok, (lp, alts) in zip(toks, entries)
            ]
        }
    tokens = [_token_text(st, t) for t in toks]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _ in entries],
        "top_logprobs": [{_token_text(st, a): alp for a, alp in alts} for _, alts in entries],
        "text_offset": offsets,
    }


async def _abort_on_disconnect(request, gens) -> None:
    """A client that went away stops its generation (vLLM does the same for non-streaming requests)."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)
    for g in gens:
        g.abort()


async def full(st, body, gens, outputs: AsyncGenerator, request, chat: bool, constraint=None, rid=None) -> dict:
    watch = asyncio.create_task(_abort_on_disconnect(request, gens))
    try:
        return await _collect(st, body, gens, outputs, chat, constraint, rid)
    finally:
        watch.cancel()


async def _collect(st, body, gens, outputs: AsyncGenerator, chat: bool, constraint, rid=None) -> dict:
    n = body.n
    texts: dict[int, list[str]] = {}
    ids: dict[int, list[int]] = {}
    lps: dict[int, list] = {}
    ends: dict[int, tuple] = {}
    async for i, out in outputs:
        if out.error:
            raise ApiError(out.error_code, f"The request failed: {out.error}")
        texts.setdefault(i, []).append(out.new_text)
        ids.setdefault(i, []).extend(out.new_token_ids)
        lps.setdefault(i, []).extend(out.logprobs or [])
        if out.finished:
            ends[i] = (out.finish_reason, out.stop_reason)
    resp = _head(st, chat, rid)
    choices = []
    for i in sorted(ends):
        text = "".join(texts.get(i, []))
        c: dict[str, Any] = {"index": i}
        finish = ends[i][0]
        if chat:
            c["message"] = {"role": "assistant", "content": text}
            calls = None if constraint is None else structured.tool_calls(constraint, text)
            if calls is not None:
                c["message"] = {"role": "assistant", "content": "", "tool_calls": calls}
                finish = "tool_calls" if constraint.tool == "" and finish == "stop" else finish
        else:
            c["text"] = _echo(st, body, gens, i) + text
        want = body.num_logprobs() is not None
        c.update(
            logprobs=_logprobs(st, ids.get(i, []), lps.get(i, []), chat) if want else None,
            finish_reason=finish,
            stop_reason=ends[i][1],
        )
        if body.return_token_ids:
            c["token_ids"] = ids.get(i, [])
            c["prompt_token_ids"] = _prompt_of(gens, n, i)
        choices.append(c)
    resp["choices"] = choices
    resp["usage"] = _usage(gens, sum(len(v) for v in ids.values()))
    return resp


async def stream(
    st, body, gens, outputs: AsyncGenerator, request, chat: bool, constraint=None, rid=None
) -> AsyncIterator[str]:
    head = _head(st, chat, rid)
    if chat:
        head["object"] = "chat.completion.chunk"
    n, started, produced = body.n, set(), 0
    want = body.num_logprobs() is not None
    offsets: dict[int, int] = {}
    calls = _StreamedCalls(constraint) if chat and constraint is not None and constraint.tool is not None else None
    try:
        async for i, out in outputs:
            if out.error:
                yield _sse(ApiError(out.error_code, f"The request failed: {out.error}").body())
                break
            produced += len(out.new_token_ids)
            finish = out.finish_reason
            if chat:
                delta = {}
                if i not in started:
                    delta["role"] = "assistant"
                if calls is not None:
                    finish = calls.delta(delta, i, i not in started, out.new_text, out.finished, finish)
                elif out.new_text or i not in started:
                    delta["content"] = out.new_text
                choice = {"index": i, "delta": delta}
            else:
                echo = "" if i in started else _echo(st, body, gens, i)
                choice = {"index": i, "text": echo + out.new_text}
            lp = None
            if want:
                lp = _logprobs(st, out.new_token_ids, out.logprobs or [], chat, offsets.get(i, 0))
                if not chat and lp["tokens"]:
                    offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            choice.update(logprobs=lp, finish_reason=finish, stop_reason=out.stop_reason)
            if body.return_token_ids:
                choice["token_ids"] = out.new_token_ids
                if i not in started:
                    choice["prompt_token_ids"] = _prompt_of(gens, n, i)
            started.add(i)
            yield _sse({**head, "choices": [choice]})
        else:
            if body.stream_options and body.stream_options.include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(gens, produced)})
        yield "data: [DONE]\n\n"
    finally:
        await outputs.aclose()  # a client that went away aborts its requests


class _StreamedCalls:
    """Tool calls as streamed deltas, as vLLM streams them: a named function's arguments as they come (the
    first delta carries its id and name); tool_choice "required"'s calls in one delta once the array is whole
    (each call's name is known only after its arguments began), or the text as content if max_tokens cut it."""

    def __init__(self, constraint):
        self.c = constraint
        self.text: dict[int, str] = {}

    def delta(self, delta: dict, i: int, first: bool, text: str, finished: bool, finish: str | None) -> str | None:
        """Fills choice i's delta; returns its finish_reason."""
        if self.c.tool:
            fn = {"arguments": text}
            if first:
                call = structured.tool_call(self.c.tool, text)
                delta["tool_calls"] = [{"index": 0, **call}]
            elif text:
                delta["tool_calls"] = [{"index": 0, "function": fn}]
            return finish
        self.text[i] = self.text.get(i, "") + text
        if not finished:
            return finish
        calls = structured.tool_calls(self.c, self.text[i])
        if calls is None:
            delta["content"] = self.text[i]
            return finish
        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
        return "tool_calls" if finish == "stop" else finish
