"""Response bodies and SSE streams for completions and chat completions, in OpenAI / vLLM shape."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from attention_node.openai_protocol import ApiError


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _head(st, chat: bool) -> dict:
    kind = ("chatcmpl-", "chat.completion") if chat else ("cmpl-", "text_completion")
    return {"id": kind[0] + uuid.uuid4().hex, "object": kind[1], "created": int(time.time()), "model": st.model_name}


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


async def full(st, body, gens, outputs: AsyncIterator, request, chat: bool) -> dict:
    watch = asyncio.create_task(_abort_on_disconnect(request, gens))
    try:
        return await _collect(st, body, gens, outputs, chat)
    finally:
        watch.cancel()


async def _collect(st, body, gens, outputs: AsyncIterator, chat: bool) -> dict:
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
    resp = _head(st, chat)
    choices = []
    for i in sorted(ends):
        text = "".join(texts.get(i, []))
        c = {"index": i}
        if chat:
            c["message"] = {"role": "assistant", "content": text}
        else:
            c["text"] = _echo(st, body, gens, i) + text
        want = body.num_logprobs() is not None
        c.update(
            logprobs=_logprobs(st, ids.get(i, []), lps.get(i, []), chat) if want else None,
            finish_reason=ends[i][0],
            stop_reason=ends[i][1],
        )
        if body.return_token_ids:
            c["token_ids"] = ids.get(i, [])
            c["prompt_token_ids"] = _prompt_of(gens, n, i)
        choices.append(c)
    resp["choices"] = choices
    resp["usage"] = _usage(gens, sum(len(v) for v in ids.values()))
    return resp


async def stream(st, body, gens, outputs: AsyncIterator, request, chat: bool) -> AsyncIterator[str]:
    head = _head(st, chat)
    if chat:
        head["object"] = "chat.completion.chunk"
    n, started, produced = body.n, set(), 0
    want = body.num_logprobs() is not None
    offsets: dict[int, int] = {}
    try:
        async for i, out in outputs:
            if out.error:
                yield _sse(ApiError(out.error_code, f"The request failed: {out.error}").body())
                break
            produced += len(out.new_token_ids)
            if chat:
                delta = {}
                if i not in started:
                    delta["role"] = "assistant"
                if out.new_text or i not in started:
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
            choice.update(logprobs=lp, finish_reason=out.finish_reason, stop_reason=out.stop_reason)
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
