"""llguidance against xgrammar, the two grammar engines afd could take for structured outputs: install size,
the time to compile a JSON schema (to the first token mask), and the time per generated token (one token
mask, one token accepted).

Run in a scratch venv beside afd's (both engines are installed there, not in .venv):

    python -m venv --system-site-packages /tmp/gvenv
    echo $PWD/.venv/lib/python3.11/site-packages > /tmp/gvenv/lib/python3.11/site-packages/afd.pth
    /tmp/gvenv/bin/pip install --no-deps llguidance==1.9.1 xgrammar==0.2.8 apache-tvm-ffi
    /tmp/gvenv/bin/python bench/grammar_engines.py

Two vocabularies: the demo checkpoint's (512 tokens) and a 32k byte-level BPE trained here on Python's own
standard library (the size of a real model's vocabulary; no hub download). The token sequence each engine
walks is the same valid JSON text, tokenized by the vocabulary; a mask is computed before every token, as a
server does. Medians of 5 runs; one thread each (afd computes masks on the engine thread).
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys
import time

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
DOC = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["red", "blue"],
    "address": {"street": "12 St James's Square", "zip": "10001"},
}
RUNS = 5


def big_vocab(n: int = 32000) -> Tokenizer:
    files = sorted(glob.glob(os.path.join(os.path.dirname(json.__file__), "..", "*.py")))[:400]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=n, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train(files, trainer)
    return tok


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_llguidance(tok: Tokenizer, ids: list[int], eos: int) -> dict:
    import llguidance
    import llguidance.torch as lt

    lltok = llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=eos)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    mask = lt.allocate_token_bitmask(1, tok.get_vocab_size())
    # llguidance builds its parser lazily: the first mask is part of the compile
    compile_s = statistics.median(
        timed(lambda: lt.fill_next_token_bitmask(llguidance.LLMatcher(lltok, grammar, log_level=0), mask, 0))
        for _ in range(RUNS)
    )

    def walk():
        m = llguidance.LLMatcher(lltok, grammar, log_level=0)
        t0 = time.perf_counter()
        for t in ids:
            lt.fill_next_token_bitmask(m, mask, 0)
            assert m.consume_token(t), m.get_error()
        lt.fill_next_token_bitmask(m, mask, 0)
        assert m.is_accepting()
        return (time.perf_counter() - t0) / (len(ids) + 1)

    return {"compile_ms": 1e3 * compile_s, "per_token_us": 1e6 * statistics.median(walk() for _ in range(RUNS))}


def bench_xgrammar(tok: Tokenizer, ids: list[int], eos: int) -> dict:
    import xgrammar as xgr

    vocab = tok.get_vocab()
    encoded = [""] * tok.get_vocab_size()
    for s, i in vocab.items():
        encoded[i] = s
    info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=len(encoded), stop_token_ids=[eos])
    text = json.dumps(SCHEMA)

    def compile_once():
        # a fresh compiler each time: the compiler caches compiled grammars by schema text
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_json_schema(text)

    mask = xgr.allocate_token_bitmask(1, len(encoded))
    compile_s = statistics.median(
        timed(lambda: xgr.GrammarMatcher(compile_once()).fill_next_token_bitmask(mask, 0)) for _ in range(RUNS)
    )
    compiled = compile_once()

    def walk():
        m = xgr.GrammarMatcher(compiled)
        t0 = time.perf_counter()
        for t in ids:
            m.fill_next_token_bitmask(mask, 0)
            assert m.accept_token(t)
        m.fill_next_token_bitmask(mask, 0)
        assert m.accept_token(eos)
        return (time.perf_counter() - t0) / (len(ids) + 1)

    return {"compile_ms": 1e3 * compile_s, "per_token_us": 1e6 * statistics.median(walk() for _ in range(RUNS))}


def installed_mb(*dists: str) -> float:
    from importlib import metadata

    total = 0
    for d in dists:
        for f in metadata.distribution(d).files or []:
            p = f.locate()
            if os.path.isfile(p):
                total += os.path.getsize(p)
    return total / 2**20


def main() -> None:
    from afd.model.demo import ensure_demo_checkpoint

    demo = Tokenizer.from_file(os.path.join(ensure_demo_checkpoint(), "tokenizer.json"))
    vocabs = {"demo (512)": (demo, 2), "BPE 32k": (big_vocab(), 2)}
    text = json.dumps(DOC)
    print(
        f"installed: llguidance {installed_mb('llguidance'):.1f} MB; xgrammar {installed_mb('xgrammar'):.1f} MB "
        f"+ apache-tvm-ffi {installed_mb('apache-tvm-ffi'):.1f} MB (+ triton, required on Linux x86_64, not "
        "installed here)"
    )
    for name, (tok, eos) in vocabs.items():
        ids = tok.encode(text, add_special_tokens=False).ids
        for engine, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
            r = fn(tok, ids, eos)
            print(
                f"{name:12s} {engine:10s} compile {r['compile_ms']:8.1f} ms   per token {r['per_token_us']:7.1f} us"
                f"   ({len(ids)} tokens)"
            )
            sys.stdout.flush()


if __name__ == "__main__":
    main()
