"""Decode tokens per second at batch B with and without a JSON schema, against a running server:

    afd serve demo --attention-nodes 1 --ffn-nodes 1 --port 8000 &
    python bench/structured_decode.py --base-url http://127.0.0.1:8000

Each round sends B streamed completions at once, all of exactly --tokens tokens: the plain ones with
ignore_eos, the constrained ones with a schema that cannot be complete by then (one string of at least 4000
characters), so both kinds decode the same number of steps. Decode tok/s counts the tokens that came after
the last request's first token, over the time from then to the last token. Rounds interleave the two kinds
and rotate which goes first; the medians are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 4000, "maxLength": 8000}},
    "required": ["text"],
    "additionalProperties": False,
}


async def one(session, url: str, body: dict) -> list[float]:
    """The arrival time of each streamed chunk that carries a token."""
    times = []
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            times += [time.perf_counter()] * len(chunk["choices"][0].get("token_ids") or [0])
    return times


async def round_(base: str, model: str, batch: int, tokens: int, constrained: bool) -> float:
    import aiohttp

    body = {"model": model, "prompt": "Attention lets", "max_tokens": tokens, "temperature": 0, "stream": True}
    body["return_token_ids"] = True
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    async with aiohttp.ClientSession() as s:
        runs = await asyncio.gather(*(one(s, base + "/v1/completions", body) for _ in range(batch)))
    assert all(len(t) == tokens for t in runs), [len(t) for t in runs]
    start, end = max(t[0] for t in runs), max(t[-1] for t in runs)
    return sum(1 for t in runs for x in t if x > start) / (end - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    import urllib.request

    with urllib.request.urlopen(a.base_url + "/v1/models") as r:
        model = json.load(r)["data"][0]["id"]
    asyncio.run(round_(a.base_url, model, a.batch, 8, True))  # warm-up: the compiler's vocabulary, first steps
    got: dict[bool, list[float]] = {False: [], True: []}
    for r in range(a.rounds):
        for constrained in (False, True) if r % 2 == 0 else (True, False):
            got[constrained].append(asyncio.run(round_(a.base_url, model, a.batch, a.tokens, constrained)))
    for constrained, xs in got.items():
        kind = "JSON schema" if constrained else "plain"
        print(f"{kind:12s} decode tok/s median {statistics.median(xs):8.1f}   rounds {[round(x, 1) for x in xs]}")


if __name__ == "__main__":
    main()
