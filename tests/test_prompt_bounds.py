"""Bounded work per prompt: the byte bound that refuses text no context can hold before it is tokenized,
tokenizing that releases the GIL, and the memory trim after large bodies."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from afd.engine.tokenizer import RELEASE_GIL_ABOVE, Tokenizer, load_tokenizer
from afd.model.demo import DEMO_CONFIG, write_tokenizer
from attention_node.openai_protocol import ApiError, Limits, check_prompt
from attention_node.prompts import check_text


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(str(path), DEMO_CONFIG["vocab_size"])
    t = load_tokenizer(str(path))
    assert t is not None
    return t


def _texts(n: int) -> list[str]:
    """Text a byte bound could get wrong: runs of spaces and newlines, control characters, accents, CJK,
    emoji, long words of one letter (a BPE merges those furthest)."""
    rng = random.Random(5)
    alphabet = list("  \n\t\x00\x07abcdefghijklmnopqrstuvwxyzAEIOU.,!?0123456789") + list("éàçñüß中文字🙂🚀ꙮ")
    out = []
    for _ in range(n):
        words = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(rng.randint(1, 80))]
        words += ["e" * rng.randint(1, 200), " " * rng.randint(1, 50)]
        rng.shuffle(words)
        out.append(" ".join(words))
    return out


def test_no_text_has_fewer_tokens_than_its_bytes_over_the_longest_token(tok):
    """The inequality the byte bound rests on, for the demo tokenizer (byte-level BPE, lossless)."""
    assert tok.lossless
    decoded = [tok.decode([i], skip_special_tokens=False) for i in range(tok.vocab_size)]
    assert tok.max_token_bytes >= max(len(s.encode()) for s in decoded)
    for text in _texts(300):
        assert len(tok.encode(text, add_special_tokens=False)) * tok.max_token_bytes >= len(text.encode()), text


def test_a_text_past_the_bound_is_refused_naming_the_limit_and_one_within_passes(tok):
    limits = Limits(max_model_len=64, vocab_size=tok.vocab_size)
    bound = tok.text_bound(64)
    assert bound == 64 * tok.max_token_bytes
    for text in ("x" * (bound + 1), "é" * (bound // 2 + 1), "中" * (bound // 3 + 1)):
        with pytest.raises(ApiError) as e:
            check_text(text, tok, limits, "prompt")
        assert e.value.code == 400 and e.value.param == "prompt"
        assert "maximum context length is 64 tokens" in e.value.message and str(bound) in e.value.message
    check_text("x" * bound, tok, limits, "prompt")  # within the bound: left to the token count
    check_text("é" * (bound // 2), tok, limits, "prompt")


def test_a_tokenizer_that_drops_text_gets_no_byte_bound(tmp_path):
    """WordPiece behind a whitespace pre-tokenizer drops spaces and makes a long word one [UNK]: a megabyte
    of it is a single token, so its size says nothing about its token count."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    wp = HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]", max_input_chars_per_word=100))
    wp.pre_tokenizer = pre_tokenizers.Whitespace()
    wp.save(str(tmp_path / "tokenizer.json"))
    t = Tokenizer(str(tmp_path))
    assert not t.lossless and t.text_bound(64) is None
    check_text(" " * 10**5, t, Limits(64, t.vocab_size), "prompt")  # no bound: not refused by size
    assert len(t.encode(" " * 10**5 + "a")) == 1


def test_a_token_id_prompt_past_the_context_is_refused_by_its_length_first():
    """The length is checked before any id: an over-long list never costs a pass over its ids."""
    with pytest.raises(ApiError, match="maximum context length is 64 tokens. However, your request has 10000"):
        check_prompt([-1] * 10_000, Limits(64, 100))
    with pytest.raises(ApiError, match="Token id -1 is out of vocabulary"):
        check_prompt([5, -1], Limits(64, 100))


def test_long_texts_tokenize_with_the_gil_released(tok):
    """A 3 MB prompt held the GIL for 14 s in `tokenizers`' single encode: no other thread of the node ran
    (its engine, so the FFN node waited on it, nor its heartbeats). A thread of torch ops keeps ticking while
    a long text tokenizes; the ids are those of the single call."""
    text = " ".join(_texts(40)) * 6
    assert len(text) > 20 * RELEASE_GIL_ABOVE
    ticks: list[float] = []
    stop = threading.Event()

    def ticker():
        x = torch.ones(32, 32)
        while not stop.is_set():
            x = x * 1.0  # an op that releases the GIL and takes it back, as the engine's do
            ticks.append(time.perf_counter())

    th = threading.Thread(target=ticker, daemon=True)
    th.start()
    time.sleep(0.1)
    t0 = time.perf_counter()
    longest = 0.0
    while longest < 0.2:  # a call long enough that a held GIL shows (a fast CPU: a longer text)
        start = time.perf_counter()
        ids = tok.encode(text)
        longest = max(longest, time.perf_counter() - start)
        text += text if longest < 0.2 else ""
    stop.set()
    th.join(5)
    gaps = [b - a for a, b in zip(ticks, ticks[1:]) if b > t0]
    assert ids == tok._tok.encode(text).ids
    assert tok.decode(ids) == tok._tok.decode(ids)  # the long decode takes the batch call too
    # a held GIL stops the ticker for a whole call; released, its gaps are scheduling noise (2 shared cores)
    assert max(gaps) < longest / 2, (longest, max(gaps))


def test_a_child_process_refuses_an_id_list_no_context_holds():
    """The large-body check parses in its own process (its GIL, not the node's): an over-long id list, alone or
    in a batch, gets the 400 check_prompt would give; anything else is left to the node. A child that dies is
    replaced."""
    import asyncio
    import json

    from attention_node.body_check import verdict
    from attention_node.large_bodies import BodyChecker

    long = json.dumps({"prompt": [7] * 700_000}).encode()
    short = json.dumps({"prompt": [[7] * 10, [7] * 9]}).encode()
    err = verdict(long, 4096, 100)
    assert err is not None and err["error"]["param"] == "input_tokens"
    with pytest.raises(ApiError) as e:
        check_prompt([7] * 700_000, Limits(4096, 100))
    assert err["error"]["message"] == e.value.message
    assert verdict(json.dumps({"prompt": [[1], [7] * 4096]}).encode(), 4096, 100) is not None
    for other in (short, b"not json", b"[1, 2]", json.dumps({"prompt": "x" * 10**6}).encode()):
        assert verdict(other, 4096, 100) is None, other[:20]

    checker = BodyChecker(4096, 100)
    try:
        assert asyncio.run(checker.check(long)) == err
        assert asyncio.run(checker.check(short)) is None
        assert checker._child is not None
        checker._child.proc.kill()
        checker._child.proc.wait(5)
        assert asyncio.run(checker.check(long)) == err  # a new child
    finally:
        checker.close()


@pytest.mark.parametrize(
    "doc, param, child, node",
    [
        ({"logit_bias": {str(i): 1.0 for i in range(101)}}, "logit_bias", "more than 100 entries", "has 101 entries"),
        ({"stop_token_ids": [1] * 101}, "stop_token_ids", "more than 100 entries", "has 101 entries"),
        ({"stop": ["x"] * 1025}, "stop", "more than 1024 strings", "has 1025 strings"),
        ({"messages": [{"role": "user", "content": "x"}] * 65}, "messages", "more than 64 messages", "65 messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 65}]},
            "messages",
            "more than 64 content parts",
            "65 content parts",
        ),
    ],
    ids=["logit_bias", "stop_token_ids", "stop", "messages", "parts"],
)
def test_lists_past_what_the_model_can_use_are_refused_by_the_child_and_the_node(doc, param, child, node):
    """A regression: a 10^6-entry logit_bias, 3M stop ids, 300k messages or 1M content parts held every stream
    for seconds while the node parsed them. The child refuses such a body before the node parses it, reading the
    list only up to its bound (so it says "more than"); the node refuses the same, with the count, on a body small
    enough to parse (openai_protocol.sampling_params, the chat route)."""
    import json

    from attention_node.body_check import MAX_STOP_STRINGS, bounds_error, verdict

    assert MAX_STOP_STRINGS == 1024
    limits = Limits(64, 100)
    err = verdict(json.dumps(doc).encode(), limits.max_model_len, limits.vocab_size)
    assert err is not None and err["error"]["param"] == param and child in err["error"]["message"], err
    message, got = bounds_error(doc, limits.max_model_len, limits.vocab_size)
    assert got == param and node in message, message
    within = {k: (dict(list(v.items())[:100]) if isinstance(v, dict) else v[:64]) for k, v in doc.items()}
    for m in within.get("messages", []):
        m["content"] = m["content"][:64]
    assert verdict(json.dumps(within).encode(), limits.max_model_len, limits.vocab_size) is None
