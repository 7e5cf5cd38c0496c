"""Large completion and chat bodies are parsed first in a child process, so that a token-id prompt no context
can hold, or a list past its bound (`bounds_error`: logit_bias, stop lists, messages and their parts), is refused
without the node parsing it. JSON and pydantic hold the GIL: 10 M ids (30 MB) took 2.5 s in which
the node's engine thread did not step (and the FFN node, waiting for its step, held every other node). The
child parses with its own GIL and answers with the 400 to send, or nothing (then the node parses the body as
usual: a body that fits a context is quick to parse).

The child runs this module (`python -m attention_node.body_check`), which imports nothing heavy: stdin takes
a header (body length, max_model_len, vocabulary size) and the body; stdout gives one JSON line, the error or null.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import subprocess
import sys
import threading

from attention_node.body_scan import Over, bounded_loads

CHECK_ABOVE = 1 << 20
"""Completion and chat bodies over this many bytes go to the child first (a full context of ids is about 1 MB at
128 K)."""
CHECKED_PATHS = ("/v1/completions", "/v1/chat/completions")
TIMEOUT_S = 30.0
_HEADER = struct.Struct("<QQQ")
MAX_STOP_STRINGS = 1024
"""Stop strings a request may give (vLLM sets no bound; each is matched against every new token's text)."""


def bounds_error(doc: dict, max_model_len: int, vocab_size: int) -> tuple[str, str] | None:
    """(message, param) for a request whose lists are past what the model can use: more logit_bias entries or
    stop_token_ids than the vocabulary has tokens, more than MAX_STOP_STRINGS stop strings, more messages or
    content parts than a context has tokens. The node checks the same on every body it parses (openai_protocol),
    and the child on a large one before the node parses it: a 10^6-entry logit_bias held every stream 2.9 s."""
    for key in ("logit_bias", "stop_token_ids"):
        value = doc.get(key)
        if isinstance(value, (dict, list)) and len(value) > vocab_size:
            return f"{key} has {len(value)} entries; this model's vocabulary has {vocab_size} tokens.", key
    stop = doc.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        return f"stop has {len(stop)} strings; this server takes at most {MAX_STOP_STRINGS}.", "stop"
    messages = doc.get("messages")
    if isinstance(messages, list):
        return messages_error([m.get("content") if isinstance(m, dict) else None for m in messages], max_model_len)
    return None


def messages_error(contents: list, max_model_len: int) -> tuple[str, str] | None:
    """(message, param) for a conversation of more messages, or more content parts (`contents`: each message's
    content, a text or a list of parts), than a context has tokens."""
    parts = sum(len(c) for c in contents if isinstance(c, list))
    for n, what in ((len(contents), "messages"), (parts, "content parts")):
        if n > max_model_len:
            message = (
                f"This model's maximum context length is {max_model_len} tokens. However, your request has {n} "
                f"{what}, more than that many tokens can hold."
            )
            return message, "messages"
    return None


def over_error(e: Over, max_model_len: int) -> tuple[str, str]:
    """bounds_error's (message, param) for a list that body_scan stopped reading past its bound."""
    if e.key in ("messages", "content parts"):
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, your request has more than "
            f"{e.bound} {e.key}, more than that many tokens can hold."
        )
        return message, "messages"
    if e.key == "stop":
        return f"stop has more than {e.bound} strings; this server takes at most {MAX_STOP_STRINGS}.", "stop"
    return f"{e.key} has more than {e.bound} entries; this model's vocabulary has {e.bound} tokens.", e.key


def verdict(body: bytes, max_model_len: int, vocab_size: int) -> dict | None:
    """The error body for a request whose token-id prompt (or one of its prompts) cannot fit the context, in
    vLLM's words (as openai_protocol.check_prompt words it), or whose lists are past their bounds
    (`bounds_error`); None for anything else. Even with truncate_prompt_tokens: truncating would have the node
    parse the whole body, which this check avoids. A bounded list is read only up to its bound (body_scan)."""
    bounds = {"logit_bias": vocab_size, "stop_token_ids": vocab_size, "stop": MAX_STOP_STRINGS}
    try:
        doc = bounded_loads(body.decode("utf-8"), {**bounds, "messages": max_model_len}, max_model_len)
    except Over as e:
        message, param = over_error(e, max_model_len)
        return {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}
    except ValueError:  # UnicodeDecodeError too: json.loads reads UTF-16 and UTF-32 as well, and says what is wrong
        try:
            doc = json.loads(body)
        except ValueError:
            return None  # the node's own parse answers it
    if isinstance(doc, dict):
        bad = bounds_error(doc, max_model_len, vocab_size)
        if bad is not None:
            return {"error": {"message": bad[0], "type": "BadRequestError", "param": bad[1], "code": 400}}
    prompt = doc.get("prompt") if isinstance(doc, dict) else None
    items = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else [prompt]
    for p in items:
        if isinstance(p, list) and len(p) >= max_model_len:
            message = (
                f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                f"{len(p)} input tokens. Please reduce the length of the input messages."
            )
            if doc.get("truncate_prompt_tokens") is not None:  # the node would parse it all to cut it
                message += f" truncate_prompt_tokens does not apply to token ids in a body over {CHECK_ABOVE} bytes."
            return {"error": {"message": message, "type": "BadRequestError", "param": "input_tokens", "code": 400}}
    return None


class BodyChecker:
    """The node's side: one child, started on first use, one body at a time. A child that fails or is slow is
    replaced, and the body is left to the node's own parse."""

    def __init__(self, max_model_len: int, vocab_size: int):
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None

    def _ask(self, body: bytes) -> dict | None:
        with self._lock:
            if self._child is None or self._child.poll() is not None:
                self._child = subprocess.Popen(
                    [sys.executable, "-m", "attention_node.body_check"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
                )
            child = self._child
            assert child.stdin is not None and child.stdout is not None
            try:
                child.stdin.write(_HEADER.pack(len(body), self.max_model_len, self.vocab_size))
                child.stdin.write(body)  # a pipe write releases the GIL
                child.stdin.flush()
                line = child.stdout.readline()
                return json.loads(line) if line else None
            except (OSError, ValueError):
                self.close_locked()
                return None

    async def check(self, body: bytes) -> dict | None:
        try:
            return await asyncio.wait_for(asyncio.to_thread(self._ask, body), TIMEOUT_S)
        except asyncio.TimeoutError:
            if self._child is not None:
                self._child.kill()  # the waiting thread's read then ends, and the next body starts a new child
            return None

    def close_locked(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait(5)
            self._child = None

    def close(self) -> None:
        with self._lock:
            self.close_locked()


class CheckLargeBodies:
    """ASGI middleware (inside the guard, so after its API key and size checks): a POST completion or chat body
    over CHECK_ABOVE is read whole, shown to the child, and either refused with its 400 or handed on."""

    def __init__(self, app, max_model_len: int, vocab_size: int):
        self.app, self.checker = app, BodyChecker(max_model_len, vocab_size)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in CHECKED_PATHS:
            return await self.app(scope, receive, send)
        size = dict(scope["headers"]).get(b"content-length", b"")
        if size.isdigit() and int(size) <= CHECK_ABOVE:
            return await self.app(scope, receive, send)
        from fastapi import HTTPException
        from fastapi.responses import JSONResponse

        chunks, more = [], True
        while more:
            try:
                message = await receive()
            except HTTPException as e:  # the guard's 413 for a chunked body past the limit
                err = {"error": {"message": str(e.detail), "type": "BadRequestError", "param": "body", "code": 413}}
                return await JSONResponse(err, status_code=e.status_code)(scope, receive, send)
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        del chunks
        error = await self.checker.check(body) if len(body) > CHECK_ABOVE else None
        if error is not None:
            return await JSONResponse(error, status_code=400)(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed, body
            if replayed:
                return await receive()  # a disconnect, for the routes that watch for one
            replayed, whole, body = True, body, b""
            return {"type": "http.request", "body": whole, "more_body": False}

        await self.app(scope, replay, send)


def _serve() -> None:
    """The child: header, body, one verdict line; until stdin closes. At a lower CPU priority: where cores are
    few, the node's engine and its peers come first."""
    os.nice(10)
    src, out = sys.stdin.buffer, sys.stdout
    while True:
        header = src.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return
        size, max_model_len, vocab_size = _HEADER.unpack(header)
        out.write(json.dumps(verdict(src.read(size), max_model_len, vocab_size)) + "\n")
        out.flush()


if __name__ == "__main__":
    _serve()
