"""The tokenizer layer: the demo tokenizer, chat templates, streaming detokenization, stop strings."""

from __future__ import annotations

import json
import random

import pytest

from afd.engine.tokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, Tokenizer, find_stop, load_tokenizer
from afd.model.demo import DEMO_CONFIG, write_tokenizer

TEXTS = ["The experts compute while attention waits.", "Attention-FFN 解耦 ✓", "café naïve 🚀 ok", " two  spaces\n"]
VOCAB = DEMO_CONFIG["vocab_size"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(str(path), VOCAB)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return load_tokenizer(str(tok_dir))


def test_demo_tokenizer_layout(tok, tok_dir):
    assert tok.vocab_size == VOCAB
    assert [tok._tok.id_to_token(i) for i in range(6)] == [
        "<unk>",
        "<s>",
        "</s>",
        "<|user|>",
        "<|assistant|>",
        "<|system|>",
    ]
    assert tok.bos_token_id == DEMO_CONFIG["bos_token_id"] and tok.eos_token_ids == (DEMO_CONFIG["eos_token_id"],)
    assert json.loads((tok_dir / "generation_config.json").read_text())["eos_token_id"] == 2


def test_demo_tokenizer_is_deterministic(tok_dir, tmp_path):
    write_tokenizer(str(tmp_path), VOCAB)
    assert (tmp_path / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()


def test_other_vocab_sizes(tmp_path):
    write_tokenizer(str(tmp_path), 1024)  # more than the text has merges for: padded with reserved tokens
    assert Tokenizer(str(tmp_path)).vocab_size == 1024
    with pytest.raises(ValueError, match="at least"):
        write_tokenizer(str(tmp_path), 64)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == 1 and ids.count(1) == 1
    assert all(0 <= i < VOCAB for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text


def test_known_words_are_merged(tok):
    assert len(tok.encode("the experts", add_special_tokens=False)) == 2


def test_bos_from_add_bos_token_when_post_processor_lacks_it(tok_dir, tmp_path):
    spec = json.loads((tok_dir / "tokenizer.json").read_text())
    spec["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "tokenizer_config.json").write_text((tok_dir / "tokenizer_config.json").read_text())
    t = Tokenizer(str(tmp_path))
    assert t.encode("hi") == [1, *t.encode("hi", add_special_tokens=False)]


def test_eos_ids_from_every_config(tok_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 2]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5, "bos_token_id": 1}))
    t = Tokenizer(str(tmp_path))
    assert t.eos_token_ids == (2, 4, 5)
    assert t.bos_token == "<s>"
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is MoE?"}]
    text = tok.apply_chat_template(messages)
    assert text == "<s><|system|>\nBe brief.\n<|user|>\nWhat is MoE?\n<|assistant|>\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(1) == 1 and {3, 4, 5} <= set(ids)
    closed = tok.apply_chat_template(
        [*messages, {"role": "assistant", "content": "Experts."}], add_generation_prompt=False
    )
    assert closed.endswith("<|assistant|>\nExperts.</s>\n")
    with pytest.raises(Exception, match="unknown role"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_chat_template_is_sandboxed(tok):
    tok2 = Tokenizer.__new__(Tokenizer)
    tok2.__dict__.update(tok.__dict__, chat_template="{{ messages.__class__.__mro__ }}", _compiled_template=None)
    with pytest.raises(Exception, match="unsafe|not safely"):
        tok2.apply_chat_template([])


def _byte_ids(tok, text: str) -> list[int]:
    """One token per byte: every multi-byte character is split across several tokens."""
    return [tok._tok.token_to_id(c) for t in tok._tok.encode(text, add_special_tokens=False).tokens for c in t]


def _stream(tok, prompt, ids):
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_valid_text(tok, text):
    for ids in (tok.encode(text, add_special_tokens=False), _byte_ids(tok, text)):
        deltas = _stream(tok, tok.encode("Prompt:"), ids)
        assert "".join(deltas) == text
        assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_streaming_random_ids(tok):
    rng = random.Random(0)
    for _ in range(50):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 8))]
        ids = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
        assert "".join(_stream(tok, prompt, ids)) == tok.decode(ids)


def test_streaming_prompt_ending_mid_character(tok):
    byte_ids = _byte_ids(tok, "解")
    assert len(byte_ids) == 3
    ids = byte_ids[1:] + tok.encode(" ok", add_special_tokens=False)
    assert "".join(_stream(tok, [1, byte_ids[0]], ids)) == tok.decode(ids)


def test_demo_checkpoint_gets_a_tokenizer(tmp_path):
    from afd.model.demo import ensure_demo_checkpoint, write_checkpoint

    path = ensure_demo_checkpoint(str(tmp_path / "demo"))
    (tmp_path / "demo" / "tokenizer.json").unlink()  # a cache from before the demo had a tokenizer
    assert load_tokenizer(ensure_demo_checkpoint(path)).vocab_size == VOCAB
    # Too small a vocabulary for byte-level BPE: the checkpoint is written without a tokenizer.
    small = write_checkpoint(str(tmp_path / "small"), {**DEMO_CONFIG, "num_layers": 1, "vocab_size": 64})
    assert load_tokenizer(small) is None


def test_load_tokenizer_without_tokenizer_json(tmp_path):
    assert load_tokenizer(str(tmp_path)) is None


def test_find_stop():
    assert find_stop("hello world", ["wor"], 0) == 6
    assert find_stop("hello world", ["xyz", "o"], 0) == 4
    assert find_stop("hello world", [], 0) is None
    assert find_stop("hello world", [""], 0) is None
    assert find_stop("hello world", ["xyz"], 5) is None
    # A stop string straddling the new text is found; one wholly in the old text is not searched for.
    assert find_stop("hello world", ["lo w"], 6) == 3
    assert find_stop("hello world", ["he"], 6) is None


def test_same_ids_as_transformers(tok_dir, tok):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    sentence = "Zero experts return their input unchanged — Attention-FFN 解耦 ✓"
    assert hf(sentence)["input_ids"] == tok.encode(sentence)
    assert hf.decode(tok.encode(sentence), skip_special_tokens=True) == sentence
