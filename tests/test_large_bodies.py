"""A large body is judged by the child while it arrives (attention_node/body_check.py StreamVerdict,
attention_node/large_bodies.py), so that a 30 MB body with a list past its bound is refused once that part is in,
not after the whole has arrived and been parsed. The answer is verdict()'s on the whole body, however it is cut."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from attention_node import body_check
from attention_node.body_check import StreamVerdict, verdict
from attention_node.large_bodies import BodyChecker

MAX_LEN, VOCAB = 64, 100


class EarlyTries(StreamVerdict):
    FIRST_TRY = 16  # the start is read from the first few bytes on, as a large body's is from 64 KiB on


BODIES = {
    "logit_bias": {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(300)}},
    "stop_token_ids": {"prompt": "hi", "stop_token_ids": [1] * 300, "max_tokens": 2},
    "messages": {"messages": [{"role": "user", "content": "hi"}] * 100},
    "parts": {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 100}]},
    "ids": {"prompt": [7] * 100},
    "fits": {"prompt": "x" * 5000, "stop": ["a"] * 10, "logit_bias": {"1": 2}},
    "late key": {"prompt": "x" * 5000, "stop_token_ids": [2] * 200},
    "a later small one": {"stop_token_ids": [2] * 200, "n": 1, "x": {}},  # + a later small one, below
    "escaped key": {"stop_token_ids": [2] * 200},  # + a later one spelt with escapes
    "key in a string": {"stop": ["x"] * 2000, "prompt": 'a "stop" in the text'},
    "not UTF-8": {"prompt": "\udcff", "stop_token_ids": [2] * 200},  # a lone byte 0xff, below
}


def encoded(name: str) -> bytes:
    if name == "not UTF-8":
        return json.dumps(BODIES[name], ensure_ascii=False).encode("utf-8", "surrogateescape")
    text = json.dumps(BODIES[name])
    if name == "a later small one":
        text = text[:-1] + ', "stop_token_ids": [1, 2]}'
    if name == "escaped key":
        text = text[:-1] + ', "stop_token_id\\u0073": []}'
    return text.encode()


def streamed(body: bytes, cuts: list[int], kind: type[StreamVerdict] = EarlyTries) -> tuple[dict | None, int]:
    """The child's answer to `body` cut at `cuts`, and how many pieces it had when it answered."""
    judge = kind(MAX_LEN, VOCAB)
    for n, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(body)]), 1):
        if (error := judge.feed(body[a:b])) is not None:
            return error, n
    return judge.finish(), len(cuts) + 1


@pytest.mark.parametrize("name", BODIES)
def test_a_body_in_pieces_gets_the_verdict_of_the_whole(name):
    """Including a bounded key past its bound that a later occurrence would override in json.loads: the body
    carries the list all the same (attention_node/body_scan.py)."""
    body, rng = encoded(name), random.Random(name)
    whole = verdict(body, MAX_LEN, VOCAB)
    assert (whole is None) == (name in ("fits", "not UTF-8")), whole  # the node's parse refuses the second
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(body)), rng.randrange(1, 12)))
        assert streamed(body, cuts)[0] == whole, cuts


def test_a_list_past_its_bound_is_refused_before_the_rest_arrives(monkeypatch):
    """A 1.7 MB logit_bias past its bound at 100: refused at the first look, 64 KiB in, with nothing parsed
    after."""
    body = json.dumps({"logit_bias": {str(i): 1 for i in range(200_000)}, "prompt": "hi"}).encode()
    monkeypatch.setattr(body_check, "verdict", lambda *a: pytest.fail("the whole body parsed"))
    error, pieces = streamed(body, list(range(1 << 14, len(body), 1 << 14)), StreamVerdict)
    assert error is not None and error["error"]["param"] == "logit_bias"
    assert pieces == 4


def test_bodies_side_by_side_and_a_child_that_dies():
    """Bodies go to one child side by side: one left unfinished (a slow client) holds up no other, and a client
    that goes away is dropped. A child that dies answers None for what it held, and the next body starts a new one."""
    over = encoded("stop_token_ids")
    checker = BodyChecker(MAX_LEN, VOCAB)

    async def run() -> None:
        slow = checker.open()
        slow.feed(over[:50])  # and nothing more for now
        gone = checker.open()
        gone.feed(over[:10])
        gone.drop()
        assert await asyncio.wait_for(checker.check(over), 30) == verdict(over, MAX_LEN, VOCAB)
        assert await asyncio.wait_for(checker.check(encoded("fits")), 30) is None
        slow.feed(over[50:])
        assert (await asyncio.wait_for(slow.finish(), 30))["error"]["param"] == "stop_token_ids"
        early = checker.open()  # past its bound in its first 64 KiB: answered before its end
        early.feed(json.dumps({"stop_token_ids": [1] * 40_000}).encode()[: 70 << 10])
        assert early.verdict is not None
        assert (await asyncio.wait_for(early.verdict, 30))["error"]["param"] == "stop_token_ids"
        early.drop()
        held = checker.open()
        held.feed(over[:50])
        child = checker._child
        assert child is not None
        child.proc.kill()
        assert await asyncio.wait_for(held.finish(), 30) is None
        assert await asyncio.wait_for(checker.check(over), 30) is not None
        assert checker._child is not child

    try:
        asyncio.run(run())
    finally:
        checker.close()
