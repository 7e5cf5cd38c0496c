"""A request body read as json.loads reads it, except that a list past its bound stops the read there.

A 10^6-entry logit_bias took json.loads 0.73 s (12 MiB) and 1M content parts 0.41 s, all of it before
body_check's bounds could count anything. Here the top-level object is walked with json's own C scanners
(`scanstring`, `scan_once`) one value at a time, and the lists that have a bound are read one entry at a time:
the read ends at the first entry past the bound, after a few hundred entries where the model's vocabulary or
context is that small. Every other value, and every list within its bound, comes out exactly as json.loads gives
it, duplicate keys included (the last one counts). A bounded key is held to its bound wherever it occurs, even where
a later occurrence would be the one json.loads keeps: a body that carries a list past its bound is refused, and
so the start of a body can be judged before the rest arrives (`first_over`). A message whose "content" key occurs
twice is judged by the parts of both. The chat and completion protocols' own checks (openai_protocol) judge what
this lets through.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from json import JSONDecoder
from json.decoder import scanstring  # type: ignore[attr-defined]  # CPython has it; typeshed leaves it out

_SCAN = JSONDecoder().scan_once  # type: ignore[attr-defined]  # set by JSONDecoder.__init__; not in typeshed
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
        value, end = _walk(text, bounds, parts_bound)
    except StopIteration as e:
        raise ValueError(f"JSON: nothing to read at {e.value}") from None
    except IndexError:
        raise ValueError("JSON: the text ends early") from None
    if _ws(text, end) != len(text):
        raise ValueError("JSON: extra data")
    return value


def first_over(text: str, bounds: dict[str, int], parts_bound: int | None = None) -> Over | None:
    """The Over that bounded_loads raises on any body that starts with `text`; None where the text ends (or stops
    being JSON) before one."""
    try:
        _walk(text, bounds, parts_bound)
    except Over as e:
        return e
    except (ValueError, IndexError, StopIteration):
        return None
    return None


def _walk(text: str, bounds: dict[str, int], parts_bound: int | None) -> tuple[object, int]:
    """The value `text` starts with, and where it ends."""

    def top(key: str, i: int) -> tuple[object, int]:
        if key in bounds and text[i] in "[{":
            parts = [0] if key == "messages" and parts_bound is not None else None
            return _bounded(text, i, key, bounds[key], parts, parts_bound or 0)
        return _SCAN(text, i)

    i = _ws(text, 0)
    return _object(text, i, top) if text[i : i + 1] == "{" else _SCAN(text, i)


def _ws(text: str, i: int) -> int:
    m = _WS.match(text, i)
    assert m is not None  # "*": it matches, if only the empty string
    return m.end()


_KEY = re.compile(r'"([^"\\\x00-\x1f]*)"[ \t\n\r]*:[ \t\n\r]*')
"""A key with no escapes, its colon, and the space up to its value: one match where a key is read most often
(a message's); other keys go through scanstring."""
_PAST = {c: re.compile(rf"[ \t\n\r]*([,\{c}])[ \t\n\r]*") for c in "}]"}
"""What follows an entry: a comma or the closing bracket, and the space around it."""


def _object(text: str, i: int, read: Callable[[str, int], tuple[object, int]]) -> tuple[dict, int]:
    """The object at `i`, each value read by read(key, where it starts)."""
    out: dict = {}
    i = _ws(text, i + 1)
    done = text[i] == "}"
    i += done
    while not done:
        if m := _KEY.match(text, i):
            key, i = m[1], m.end()
        else:
            if text[i] != '"':
                raise ValueError("JSON: expected a key")
            key, i = scanstring(text, i + 1)
            i = _ws(text, i)
            if text[i] != ":":
                raise ValueError("JSON: expected ':'")
            i = _ws(text, i + 1)
        out[key], i = read(key, i)
        done, i = _next(text, i, "}")
    return out, i


def _list(text: str, i: int, read: Callable[[int], tuple[object, int]], bound: int, key: str) -> tuple[list, int]:
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
    m = _PAST[closing].match(text, i)
    if m is None:
        if i >= len(text):
            raise IndexError(i)  # the text ends here
        raise ValueError(f"JSON: expected ',' or '{closing}'")
    return m[1] == closing, m.end()


def _flat(text: str, i: int) -> bool:
    """Whether the object at `i` holds no list or object: the first "}" after it ends it (no "{" or "[" before,
    and no escape or odd quote that could put it in a string). Then a scan of it is as bounded as it is: a message
    whose content is a text, the most common, is read whole at once."""
    end = text.find("}", i)
    return (
        end > 0
        and text.find("[", i, end) < 0
        and text.find("{", i + 1, end) < 0
        and text.find("\\", i, end) < 0
        and text.count('"', i, end) % 2 == 0
    )


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
        if parts is None or text[j] != "{" or _flat(text, j):  # a message with no list has no parts
            return _SCAN(text, j)
        return _object(text, j, content)

    return _list(text, i, item, bound, key)
