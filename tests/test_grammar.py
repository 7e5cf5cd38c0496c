"""Structured outputs in the sampler, without a cluster: the grammar's bitmask on constrained rows only, a
constrained row's draft never kept, and the rejection rule on rows without a draft."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch

from afd.engine.grammar import GrammarCompiler, GrammarError, GrammarSpec
from afd.engine.logits import History
from afd.engine.sampling import Row, Sampler, SamplingParams
from afd.engine.tokenizer import Tokenizer
from afd.model.demo import ensure_demo_checkpoint

V, EOS = 512, 2
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "c": {"enum": ["x", "y"]}},
    "required": ["n", "c"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def demo():
    path = ensure_demo_checkpoint()
    return GrammarCompiler(os.path.join(path, "tokenizer.json"), V, (EOS,)), Tokenizer(path)


def _row(grammar=None, draft=None, p=None):
    return Row(p or SamplingParams(), "r", History([], []), draft, grammar)


def test_the_mask_makes_random_logits_valid_and_leaves_other_rows_alone(demo):
    compiler, tok = demo
    g, s = compiler.compile(GrammarSpec("json", SCHEMA, any_whitespace=False)), Sampler((EOS,))
    gen, out = torch.Generator().manual_seed(0), []
    for _ in range(64):
        logits = torch.randn(3, V, generator=gen)
        drawn = s.draw(logits.clone(), [_row(), _row(g), _row()])
        assert [drawn[0].token, drawn[2].token] == [int(logits[0].argmax()), int(logits[2].argmax())]
        out.append(drawn[1].token)
        if g.advance(drawn[1].token):
            break
    assert json.loads(tok.decode(out)).keys() == {"n", "c"} and g.accepting


def test_a_constrained_rows_draft_is_never_kept(demo):
    compiler, _ = demo
    g = compiler.compile(GrammarSpec("choice", ["ab"]))
    logits = torch.zeros(2, V)
    logits[:, 7] = 50.0  # the draft, token 7, is every row's argmax, but the grammar forbids it
    drawn = Sampler((EOS,)).draw(logits, [_row(g, draft=0), _row()], torch.tensor([7]))
    assert not drawn[0].kept and drawn[0].token != 7


def test_an_invalid_spec_is_a_grammar_error(demo):
    compiler, _ = demo
    for spec in (GrammarSpec("json", {"type": "strin"}), GrammarSpec("regex", "[a-"), GrammarSpec("grammar", "x ::=")):
        with pytest.raises(GrammarError):
            compiler.compile(spec)


def test_compiles_are_bounded_in_size_and_time_and_fail_in_one_line(demo):
    """A spec past the size bound is refused before it is compiled; a compile that takes longer
    than its limit is given up; llguidance's error is one line, never a panic's backtrace; and the compiles run
    on threads of their own, not the default pool that tokenizes prompts."""
    import asyncio
    import threading
    import time

    from afd.engine.grammar import MAX_ERROR_LEN, one_line

    compiler, _ = demo
    many = GrammarSpec("choice", [f"option {i}" for i in range(2_000)])
    t0 = time.monotonic()
    with pytest.raises(
        GrammarError, match=r"it is \d+ bytes; this server compiles at most 1024 \(http.max_grammar_bytes"
    ):
        asyncio.run(compiler.compile_async(many, max_bytes=1024))
    assert time.monotonic() - t0 < 0.5  # refused by its size, not compiled
    with pytest.raises(GrammarError, match="compiling it took longer than 0.001 s"):
        asyncio.run(compiler.compile_async(many, max_bytes=1 << 30, timeout=0.001))
    seen = []
    spec = GrammarSpec("regex", "[ab]+")
    real = compiler.compile
    compiler.compile = lambda s: seen.append(threading.current_thread().name) or real(s)
    try:
        assert asyncio.run(compiler.compile_async(spec, max_bytes=1024)) is not None
    finally:
        del compiler.compile
    assert seen and seen[0].startswith("afd-grammar"), seen
    with pytest.raises(GrammarError) as err:
        compiler.compile(GrammarSpec("grammar", "start: " + " | ".join(f'"x{i}"' for i in range(50_000)) + " | ("))
    assert "\n" not in str(err.value) and len(str(err.value)) <= MAX_ERROR_LEN + 3
    panic = "thread '<unnamed>' panicked at src/x.rs:1:2:\nlimit\nstack backtrace:\n   0: rust_begin_unwind"
    assert "panicked" not in one_line(panic) and "internal error" in one_line(panic)


def test_a_row_without_a_draft_draws_from_its_distribution_in_a_drafting_batch():
    """The bonus row after a kept draft has no draft: u * q(x) < p(x) with q = 0 kept its placeholder, token 0."""
    logits = torch.full((2, 8), -20.0)
    logits[:, 5] = 20.0
    hot, s = SamplingParams(temperature=1.0), Sampler()
    tokens = Counter(s.draw(logits, [_row(draft=0, p=hot), _row(p=hot)], torch.tensor([5]))[1].token for _ in range(50))
    assert tokens == {5: 50}


def test_a_step_with_drafts_emits_one_token_for_a_constrained_request_and_all_kept_for_others(demo):
    """sample_step over a plan where both requests verify 2 drafts that are every row's argmax: the
    unconstrained one keeps both (3 tokens), the constrained one emits its masked row 0's token alone."""
    from afd.engine.messages import ScheduledSeq, StepPlan
    from afd.engine.request import Request
    from afd.engine.sampling import sample_step

    compiler, _ = demo
    g = compiler.compile(GrammarSpec("choice", ["ab"]))
    reqs = [Request(r, [1, 5], SamplingParams(), 8, lambda out: None, grammar=gr) for r, gr in (("c", g), ("u", None))]
    drafts = torch.tensor([7, 7])
    plan = StepPlan(tuple(ScheduledSeq(r, 2, 3, 2, True, drafts) for r in reqs))
    logits = torch.zeros(6, V)
    logits[:, 7] = 50.0
    out = sample_step(Sampler((EOS,)), plan, logits)
    assert not out.errors, out.errors
    assert len(out.tokens[0]) == 1 and out.tokens[0][0] != 7 and out.tokens[1] == [7, 7, 7]
    g.advance(out.tokens[0][0])  # the token fits the grammar (advance raises if not)


def test_request_fields_take_the_structured_fields_and_the_guided_names():
    from attention_node import request_fields
    from attention_node.openai_protocol import ApiError, ChatCompletionRequest, CompletionRequest

    msgs = {"messages": [{"role": "user", "content": "hi"}]}
    tools = [{"type": "function", "function": {"name": "f"}}]
    chat = ChatCompletionRequest.model_validate(
        {**msgs, "tools": tools, "tool_choice": "required", "guided_regex": "a", "response_format": {"type": "text"}}
    )
    assert request_fields.check(chat, chat=True) == []  # taken, none counted as unknown
    text = CompletionRequest.model_validate({"prompt": "x", "guided_choice": ["a"], "structured_outputs": {}})
    assert request_fields.check(text, chat=False) == []
    for field in ({"tools": tools}, {"structural_tag": "{}"}, {"guided_decoding_backend": "xgrammar"}):
        with pytest.raises(ApiError, match=next(iter(field))):
            request_fields.check(CompletionRequest.model_validate({"prompt": "x", **field}), chat=False)
