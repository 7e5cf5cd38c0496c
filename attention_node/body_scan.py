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
from collections.abc import Callable
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

    def top(key: str, i: int) -> tuple[object, int]:
        if key in bounds and text[i] in "[{" and text.count(f'"{key}"') == 1:
            parts = [0] if key == "messages" and parts_bound is not None else None
            return _bounded(text, i, key, bounds[key], parts, parts_bound or 0)
        return _SCAN(text, i)

    try:
        i = _ws(text, 0)
        value, end = _object(text, i, top) if text[i : i + 1] == "{" else _SCAN(text, i)
    except StopIteration as e:
        raise ValueError(f"JSON: nothing to read at {e.value}") from None
    except IndexError:
        raise ValueError("JSON: the text ends early") from None
    if _ws(text, end) != len(text):
        raise ValueError("JSON: extra data")
    return value


def _ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()


def _object(text: str, i: int, read: Callable[[str, int], tuple[object, int]]) -> tuple[dict, int]:
    """The object at `i`, each value read by read(key, where it starts)."""
    out: dict = {}
    i = _ws(text, i + 1)
    done = text[i] == "}"
    i += done
    while not done:
        if text[i] != '"':
            raise ValueError("JSON: expected a key")
        key, i = scanstring(text, i + 1)
        i = _ws(text, i)
        if text[i] != ":":
            raise ValueError("JSON: expected ':'")
        out[key], i = read(key, _ws(text, i + 1))
        done, i = _next(text, i, "}")
    return out, i


def _list(text: str, i: int, read: Callable[[int], object], bound: int, key: str) -> tuple[list, int]:
    """The list at `i`, each entry read by read(where it starts); Over at entry bound + 1."""
    out: list = []
    i = _ws(text, i + 1)
    done = text[i] == "]"
    i += done
    while not done:
        value, i = read(i)
        out.append(value)
        if len(out) > bound:
            raise Over(key, bound)
        done, i = _next(text, i, "]")
    return out, i


def _next(text: str, i: int, closing: str) -> tuple[bool, int]:
    """Past an entry: (True, past the closing bracket) at the end, else (False, where the next entry starts)."""
    i = _ws(text, i)
    if text[i] == closing:
        return True, i + 1
    if text[i] != ",":
        raise ValueError(f"JSON: expected ',' or '{closing}'")
    return False, _ws(text, i + 1)


def _bounded(
    text: str, i: int, key: str, bound: int, parts: list[int] | None, parts_bound: int
) -> tuple[list | dict, int]:
    """The list or object at `i`, read an entry at a time: Over at entry bound + 1 (an object's distinct keys, as
    len() of json.loads' dict counts them). parts: the entries are messages, whose content parts count together
    (parts[0]) against parts_bound."""
    if text[i] == "{":
        seen: set[str] = set()

        def entry(k: str, j: int) -> tuple[object, int]:
            seen.add(k)
            if len(seen) > bound:
                raise Over(key, bound)
            return _SCAN(text, j)

        return _object(text, i, entry)

    def content(k: str, j: int) -> tuple[object, int]:  # a message's key
        if k != "content" or text[j] != "[":
            return _SCAN(text, j)

        def part(m: int) -> tuple[object, int]:
            assert parts is not None
            parts[0] += 1
            if parts[0] > parts_bound:
                raise Over("content parts", parts_bound)
            return _SCAN(text, m)

        return _list(text, j, part, parts_bound, "content parts")

    def item(j: int) -> tuple[object, int]:
        return _object(text, j, content) if parts is not None and text[j] == "{" else _SCAN(text, j)

    return _list(text, i, item, bound, key)
