"""A request body read as json.loads reads it, except that a list past its bound stops the read there.

A 10^6-entry logit_bias took json.loads 0.73 s (12 MiB) and 1M content parts 0.41 s, all of it before
body_check's bounds could count anything. Here the top-level object is walked with json's own C scanners
(`scanstring`, `scan_once`) one value at a time, and the lists that have a bound are read one entry at a time:
the read ends at the first entry past the bound, after a few hundred entries where the model's vocabulary or
context is that small. Every other value, and every list within its bound, comes out exactly as json.loads gives
it, duplicate keys included (the last one counts); a bounded key that occurs more than once in the body is read
whole, since its last occurrence decides. A message whose "content" key occurs twice is judged by the parts of
both. The chat and completion protocols' own checks (openai_protocol) judge what this lets through.
"""

from __future__ import annotations

import re
from json import JSONDecoder
from json.decoder import scanstring

_SCAN = JSONDecoder().scan_once
_WS = re.compile(r"[ \t\n\r]*")


class Over(Exception):
    """`key` has more than `bound` entries ("content parts" for the messages' parts together)."""

    def __init__(self, key: str, bound: int):
        super().__init__(f"{key} has more than {bound} entries")
        self.key, self.bound = key, bound


def bounded_loads(text: str, bounds: dict[str, int], parts_bound: int | None = None) -> object:
    """json.loads(text), raising Over once a top-level key of `bounds` (list or object) has one entry past its
    bound, or the messages' content parts together one past `parts_bound`; ValueError where json.loads would
    raise (and where this reader cannot follow: the caller then parses with json.loads)."""
    try:
        i = _ws(text, 0)
        if text[i : i + 1] != "{":
            value, end = _SCAN(text, i)
        else:
            value, end = _object(text, i, bounds, parts_bound)
    except StopIteration as e:
        raise ValueError(f"JSON: nothing to read at {e.value}") from None
    except IndexError:
        raise ValueError("JSON: the text ends early") from None
    if _ws(text, end) != len(text):
        raise ValueError("JSON: extra data")
    return value


def _ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()


def _object(text: str, i: int, bounds: dict[str, int], parts_bound: int | None) -> tuple[dict, int]:
    doc: dict = {}
    i = _ws(text, i + 1)
    if text[i] == "}":
        return doc, i + 1
    while True:
        key, i = _key(text, i)
        once = key in bounds and text.count(f'"{key}"') == 1
        if once and text[i] in "[{":
            doc[key], i = _bounded(text, i, key, bounds[key], parts_bound if key == "messages" else None)
        else:
            doc[key], i = _SCAN(text, i)
        i = _ws(text, i)
        if text[i] == "}":
            return doc, i + 1
        if text[i] != ",":
            raise ValueError("JSON: expected ',' or '}'")
        i = _ws(text, i + 1)


def _key(text: str, i: int) -> tuple[str, int]:
    """The object key at `i` and where its value starts."""
    if text[i] != '"':
        raise ValueError("JSON: expected a key")
    key, i = scanstring(text, i + 1)
    i = _ws(text, i)
    if text[i] != ":":
        raise ValueError("JSON: expected ':'")
    return key, _ws(text, i + 1)


def _bounded(text: str, i: int, key: str, bound: int, parts_bound: int | None) -> tuple[list | dict, int]:
    """The list or object at `i`, read an entry at a time; Over at entry bound + 1 (an object's distinct keys, as
    len() of json.loads' dict counts them). parts_bound: the entries are messages, whose content parts count
    together against it."""
    closing = "]" if text[i] == "[" else "}"
    out: list | dict = [] if closing == "]" else {}
    parts = [0]
    i = _ws(text, i + 1)
    if text[i] == closing:
        return out, i + 1
    while True:
        if isinstance(out, dict):
            k, i = _key(text, i)
            out[k], i = _SCAN(text, i)
        elif parts_bound is not None and text[i] == "{":
            message, i = _message(text, i, parts, parts_bound)
            out.append(message)
        else:
            value, i = _SCAN(text, i)
            out.append(value)
        if len(out) > bound:
            raise Over(key, bound)
        i = _ws(text, i)
        if text[i] == closing:
            return out, i + 1
        if text[i] != ",":
            raise ValueError(f"JSON: expected ',' or '{closing}'")
        i = _ws(text, i + 1)


def _message(text: str, i: int, parts: list[int], parts_bound: int) -> tuple[dict, int]:
    """A chat message object, its "content" list read a part at a time against the conversation's parts so far
    (parts[0])."""
    message: dict = {}
    i = _ws(text, i + 1)
    if text[i] == "}":
        return message, i + 1
    while True:
        key, i = _key(text, i)
        if key == "content" and text[i] == "[":
            content: list = []
            i = _ws(text, i + 1)
            while text[i] != "]":
                value, i = _SCAN(text, i)
                content.append(value)
                parts[0] += 1
                if parts[0] > parts_bound:
                    raise Over("content parts", parts_bound)
                i = _ws(text, i)
                if text[i] == ",":
                    i = _ws(text, i + 1)
                elif text[i] != "]":
                    raise ValueError("JSON: expected ',' or ']'")
            message[key], i = content, i + 1
        else:
            message[key], i = _SCAN(text, i)
        i = _ws(text, i)
        if text[i] == "}":
            return message, i + 1
        if text[i] != ",":
            raise ValueError("JSON: expected ',' or '}'")
        i = _ws(text, i + 1)
