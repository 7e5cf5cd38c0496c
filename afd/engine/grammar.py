"""Structured outputs: a request's constraint (a JSON schema, any JSON object, a regex, a choice of strings or a
Lark / GBNF grammar) compiled by llguidance (https://github.com/guidance-ai/llguidance) into a matcher that
says which tokens may come next, as a bitmask, and advances with each token the request emits.

Why llguidance: docs/benchmarks/structured-outputs.md (measured against xgrammar, which vLLM also uses).

Who does what: the API compiles a `GrammarSpec` on a worker thread (`GrammarCompiler.compile`, which also
computes the first mask, so that an invalid schema is a 400 before the request enters the engine and no
grammar is built on the engine thread); the sampler fills one bitmask [Rc, ceil(V / 32)] for the step's
constrained rows (`fill_masks`, one llguidance call for the batch) and applies it on the
logits' device (afd.engine.sample_ops.apply_bitmask); the output processor advances the matcher with each
token and ends the request when the grammar is complete (`Grammar.advance`). EOS is in the mask only where
the grammar may end, so a constrained request ends by completing it, or at max_tokens (finish_reason
length, its text then incomplete).
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"
"""Whitespace a JSON grammar takes between tokens by default: at most 16 characters at a time (room for
indentation), so that a model that would emit whitespace forever still has to finish the value."""
KINDS = ("json", "json_object", "regex", "choice", "grammar")


COMPILE_THREADS = 2
"""Compiles at once; more wait for a thread (their wait counts toward COMPILE_TIMEOUT_S)."""
COMPILE_TIMEOUT_S = 10.0
"""Seconds a request waits for its grammar before a 400: eight 100k-entry choice lists once held a plain request
for 95 s on the pool that tokenizes prompts."""
MAX_ERROR_LEN = 300
"""Characters of llguidance's error in the 400 (a panic's message carries its backtrace)."""


def one_line(text: str) -> str:
    """The first line of an error, cut to MAX_ERROR_LEN; a Rust panic's text (where in llguidance's sources, and
    its backtrace) is no help to a client and is not passed on."""
    first = (text.strip().splitlines() or [""])[0]
    if "panicked at" in first:
        return "llguidance failed on it (an internal error: a limit it does not check, or a bug)"
    return first if len(first) <= MAX_ERROR_LEN else f"{first[:MAX_ERROR_LEN]}..."


class GrammarError(ValueError):
    """The constraint does not compile (an invalid schema, regex or grammar), or a token broke it."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to (vLLM's StructuredOutputsParams, vllm/sampling_params.py)."""

    kind: str
    """json (a JSON schema), json_object (any JSON object), regex, choice or grammar (Lark or GBNF)."""
    value: Any = None
    """The schema (a dict), the regex or grammar text, or the list of choices."""
    any_whitespace: bool = True
    """False: no whitespace between JSON tokens (vLLM's disable_any_whitespace)."""
    whitespace_pattern: str | None = None
    """A regex for the whitespace between JSON tokens, instead of WHITESPACE."""
    no_additional_properties: bool = False
    """An object schema that does not say additionalProperties takes none (vLLM's disable_additional_properties)."""

    def size(self) -> int:
        """Bytes of the spec as a client sends it: the schema or the choices as JSON, the regex or grammar's text."""
        value = self.value
        return len(value.encode() if isinstance(value, str) else json.dumps(value).encode())

    def llguidance(self) -> str:
        """The llguidance grammar text (no check here: compiling does that)."""
        from llguidance import LLMatcher, grammar_from

        if self.kind in ("json", "json_object"):
            schema = {"type": "object"} if self.kind == "json_object" else self.value
            if self.no_additional_properties:
                schema = _closed(copy.deepcopy(schema))
            options: dict = {"whitespace_flexible": self.any_whitespace}
            if self.any_whitespace:
                options["whitespace_pattern"] = self.whitespace_pattern or WHITESPACE
            text = schema if isinstance(schema, dict) else json.dumps(schema)  # `true`: any JSON value
            return LLMatcher.grammar_from_json_schema(text, defaults=options)  # type: ignore[arg-type]
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            return grammar_from("choice", json.dumps(list(self.value)))
        if self.kind == "grammar":
            try:
                return grammar_from("grammar", self.value)  # Lark as is, GBNF converted to Lark
            except ValueError as e:
                raise GrammarError(str(e)) from None
        raise GrammarError(f"unknown constraint {self.kind!r}; expected one of {', '.join(KINDS)}")


def _closed(schema):
    """additionalProperties: false on every object schema that does not set it."""
    if isinstance(schema, dict):
        if schema.get("type") == "object" or "properties" in schema:
            schema.setdefault("additionalProperties", False)
        for v in schema.values():
            _closed(v)
    elif isinstance(schema, list):
        for v in schema:
            _closed(v)
    return schema


class Grammar:
    """One request's matcher: where its output is in the grammar."""

    def __init__(self, matcher):
        self.matcher = matcher

    def copy(self) -> Grammar:
        """A matcher in the same state (each of a request's n choices advances its own)."""
        return Grammar(self.matcher.deep_copy())

    def advance(self, token: int) -> bool:
        """Takes the token the request emitted; True when the grammar is complete (nothing but EOS may follow).
        Raises GrammarError when the token breaks the grammar (the mask let it through: a bug, or a logits row
        the mask does not cover)."""
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} does not fit the grammar: {self.matcher.get_error()}")
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()


class GrammarCompiler:
    """Compiles specs for one model: its tokenizer.json, its logits' width V and its EOS ids. Reading the
    tokenizer and building the vocabulary's token trie take up to a second for a large vocabulary: done once,
    in the first compile (so on the worker thread that runs it)."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos_ids: tuple[int, ...]):
        self.path, self.vocab_size, self.eos_ids = tokenizer_path, vocab_size, list(eos_ids)
        self._tok: Any = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def tokenizer(self):
        with self._lock:
            if self._tok is None:
                from llguidance import LLTokenizer

                with open(self.path, encoding="utf-8") as f:
                    text = f.read()
                try:
                    self._tok = LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos_ids or None)
                except ValueError as e:  # e.g. a tokenizer with more tokens than the model's logits
                    raise GrammarError(f"this model's tokenizer cannot constrain its output: {e}") from None
            return self._tok

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The spec's matcher, its first mask computed (a grammar that cannot start fails here). Blocking:
        call it off the engine thread and the event loop (llguidance releases the GIL while it works), as
        `compile_async` does."""
        from llguidance import LLMatcher, LLParserLimits

        tok = self.tokenizer()
        # llguidance's own resource limits, at their defaults; its verbose errors would quote the grammar and
        # the parser's state back
        limits = LLParserLimits(verbose_errors=False)
        try:  # the spec is the client's: whatever it makes llguidance raise is the client's 400
            matcher = LLMatcher(tok, spec.llguidance(), log_level=0, limits=limits)
            if not matcher.is_error():
                matcher.compute_bitmask()
        except Exception as e:
            raise GrammarError(one_line(str(e))) from None
        if matcher.is_error():
            raise GrammarError(one_line(matcher.get_error()))
        return Grammar(matcher)

    async def compile_async(self, spec: GrammarSpec, max_bytes: int, timeout: float = COMPILE_TIMEOUT_S) -> Grammar:
        """`compile` on this compiler's own threads (COMPILE_THREADS: never the pool that tokenizes prompts),
        refused past `max_bytes` of spec and given up after `timeout` seconds (the compile itself runs on, on
        its thread: llguidance cannot be stopped midway)."""
        size = spec.size()
        if size > max_bytes:
            raise GrammarError(
                f"it is {size} bytes; this server compiles at most {max_bytes} (http.max_grammar_bytes, "
                "--max-grammar-bytes)"
            )
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="afd-grammar")
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._pool, self.compile, spec), timeout)
        except TimeoutError:
            raise GrammarError(f"compiling it took longer than {timeout:g} s") from None


_executor: Any = None
_executor_lock = threading.Lock()


def fill_masks(grammars: list[Grammar], vocab_size: int) -> torch.Tensor:
    """The next token's allowed set for each grammar: int32 [len(grammars), ceil(V / 32)] on the host, bit
    t % 32 of word t // 32 set where token t may come, filled by llguidance in one call for the batch (what
    llguidance.torch.fill_next_token_bitmask_par does; that module is not imported, as its torch.compile
    decorator loads torch's compiler stack)."""
    global _executor
    from llguidance import LLExecutor

    with _executor_lock:
        if _executor is None:
            _executor = LLExecutor()
    words = (vocab_size + 31) // 32
    mask = torch.full((len(grammars), words), -1, dtype=torch.int32)
    _executor.unsafe_compute_mask_ptr(
        [(g.matcher, i) for i, g in enumerate(grammars)], mask.data_ptr(), 4 * words, len(grammars)
    )
    for g in grammars:
        if g.matcher.is_error():
            raise GrammarError(g.matcher.get_error())
    return mask
