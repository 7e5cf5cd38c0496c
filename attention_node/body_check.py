"""Large completion and chat bodies are judged first in a child process, so that a token-id prompt no context
can hold, or a list past its bound (`bounds_error`: logit_bias, stop lists, messages and their parts), is refused
without the node parsing it. JSON and pydantic hold the GIL: 10 M ids (30 MB) took 2.5 s in which
the node's engine thread did not step (and the FFN node, waiting for its step, held every other node). The
child parses with its own GIL and answers with the 400 to send, or nothing (then the node parses the body as
usual: a body that fits a context is quick to parse). It reads each body while it arrives (StreamVerdict): a list
past its bound is refused once the part that shows it is in, without waiting for the rest.

The child runs this module (`python -m attention_node.body_check MAX_MODEL_LEN VOCAB_SIZE`), which imports
nothing heavy; the node's side is attention_node/large_bodies.py. Its stdin takes frames, FRAME then the bytes:
DATA for a piece of a body, END when the body is whole, DROP when it is no longer wanted. Its stdout gives one line
for each body, as soon as the verdict is known: the body's id and the verdict as JSON, the error or null.
"""

from __future__ import annotations

import codecs
import json
import os
import struct
import sys

from attention_node.body_scan import Over, bounded_loads, first_over

CHECK_ABOVE = 1 << 20
"""Completion and chat bodies over this many bytes go to the child first (a full context of ids is about 1 MB at
128 K)."""
FRAME = struct.Struct("<QBQ")
"""A frame's header: body id, kind, length of the bytes that follow."""
DATA, END, DROP = 0, 1, 2
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
    try:
        doc = bounded_loads(body.decode("utf-8"), _bounds(max_model_len, vocab_size), max_model_len)
    except Over as e:
        return _error(*over_error(e, max_model_len))
    except ValueError:  # UnicodeDecodeError too: json.loads reads UTF-16 and UTF-32 as well, and says what is wrong
        try:
            doc = json.loads(body)
        except ValueError:
            return None  # the node's own parse answers it
    if isinstance(doc, dict):
        bad = bounds_error(doc, max_model_len, vocab_size)
        if bad is not None:
            return _error(*bad)
    fields = doc if isinstance(doc, dict) else {}
    prompt = fields.get("prompt")
    items = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else [prompt]
    for p in items:
        if isinstance(p, list) and len(p) >= max_model_len:
            message = (
                f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                f"{len(p)} input tokens. Please reduce the length of the input messages."
            )
            if fields.get("truncate_prompt_tokens") is not None:  # the node would parse it all to cut it
                message += f" truncate_prompt_tokens does not apply to token ids in a body over {CHECK_ABOVE} bytes."
            return _error(message, "input_tokens")
    return None


def _bounds(max_model_len: int, vocab_size: int) -> dict[str, int]:
    """The top-level lists body_scan reads only up to a bound, and their bounds."""
    return {
        "logit_bias": vocab_size,
        "stop_token_ids": vocab_size,
        "stop": MAX_STOP_STRINGS,
        "messages": max_model_len,
    }


def _error(message: str, param: str) -> dict:
    return {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}


class StreamVerdict:
    """verdict() of a body that arrives in pieces: its start is read at doubling sizes (first_over), so that a
    list past its bound is refused as soon as it has arrived, whatever follows; a body without one gets verdict()
    once whole. Either way the answer is verdict()'s on the whole body (where what follows the list would not be
    UTF-8, or not JSON, the Over's 400 comes first)."""

    FIRST_TRY = 64 << 10

    def __init__(self, max_model_len: int, vocab_size: int):
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.body = bytearray()
        self.next_try = self.FIRST_TRY

    def feed(self, data: bytes) -> dict | None:
        """The error once the body so far shows a list past its bound, else None (for now)."""
        self.body += data
        if len(self.body) < self.next_try:
            return None
        self.next_try = 2 * len(self.body)
        try:
            text = codecs.getincrementaldecoder("utf-8")().decode(self.body)  # holds back a character cut at the end
        except UnicodeDecodeError:  # verdict() and the node's parse say what is wrong, once the body is whole
            self.next_try = sys.maxsize
            return None
        over = first_over(text, _bounds(self.max_model_len, self.vocab_size), self.max_model_len)
        return None if over is None else _error(*over_error(over, self.max_model_len))

    def finish(self) -> dict | None:
        return verdict(bytes(self.body), self.max_model_len, self.vocab_size)


def _serve(max_model_len: int, vocab_size: int) -> None:
    """The child: frames of bodies arriving side by side, and one verdict line ("id json") for each body, as soon as
    it is known: for a list past its bound, before the body's END. Until stdin closes. At a lower CPU priority:
    where cores are few, the node's engine and its peers come first."""
    os.nice(10)
    src, out = sys.stdin.buffer, sys.stdout
    bodies: dict[int, StreamVerdict | None] = {}  # None: answered

    def answer(body_id: int, error: dict | None) -> None:
        out.write(f"{body_id} {json.dumps(error)}\n")
        out.flush()

    while True:
        header = src.read(FRAME.size)
        if len(header) < FRAME.size:
            return
        body_id, kind, size = FRAME.unpack(header)
        data = src.read(size) if size else b""
        if kind == DATA:
            if body_id not in bodies:
                bodies[body_id] = StreamVerdict(max_model_len, vocab_size)
            body = bodies[body_id]
            if body is not None and (error := body.feed(data)) is not None:
                bodies[body_id] = None
                answer(body_id, error)
        elif kind == END:
            body = bodies.pop(body_id, None) if body_id in bodies else StreamVerdict(max_model_len, vocab_size)
            if body is not None:
                answer(body_id, body.finish())
        else:  # DROP: the client went away, or the body was answered
            bodies.pop(body_id, None)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
