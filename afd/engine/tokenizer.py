"""Text in and out: an HF `tokenizer.json` read with the `tokenizers` library, chat templates, streaming
detokenization and stop strings.

transformers is deliberately not used here: it is slow to import and heavy for a serving process.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jinja2 import Template

REPLACEMENT_CHAR = "\ufffd"
RELEASE_GIL_ABOVE = 4096
"""Texts (characters) and id lists longer than this go through the `tokenizers` batch calls, which release
the GIL while Rust works: the single calls hold it throughout (a 3 MB prompt: 14 s in which no other thread
of the node, its engine and heartbeats included, ran)."""
# Text a lossy tokenizer would drop or fold (whitespace runs, control characters, accents, a long run of a
# rare character that WordPiece makes one [UNK]); a tokenizer that gives it back byte for byte covers each
# input byte with some token's bytes.
_LOSSLESS_PROBE = "  Hi\tthere\n\n\x00\x07 \u00c0\u00c9 cafe\u0301 \u4e2d\u6587 \U0001f642 " + "\ua66e" * 300 + " UP"


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(tok) -> str | None:
    # tokenizer_config.json writes special tokens either as a string or as an AddedToken dict.
    return tok.get("content") if isinstance(tok, dict) else tok


def _id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def load_tokenizer(model_dir: str) -> Tokenizer | None:
    """The model's tokenizer, or None when `model_dir` has no tokenizer.json (then prompts are token ids)."""
    if not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return None
    return Tokenizer(model_dir)


class Tokenizer:
    """tokenizer.json plus the settings HF keeps beside it (tokenizer_config.json, generation_config.json,
    config.json): special tokens, EOS ids and the chat template."""

    def __init__(self, model_dir: str):
        from tokenizers import Tokenizer as _HFTokenizer

        self._tok = _HFTokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        tc = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        gen = _read_json(os.path.join(model_dir, "generation_config.json"))
        cfg = _read_json(os.path.join(model_dir, "config.json"))
        self.bos_token = _token_content(tc.get("bos_token"))
        self.eos_token = _token_content(tc.get("eos_token"))
        bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.bos_token_id = bos_id if bos_id is not None else next(iter(_id_list(cfg.get("bos_token_id"))), None)
        if self.bos_token is None and self.bos_token_id is not None:
            self.bos_token = self._tok.id_to_token(self.bos_token_id)
        eos = [self._tok.token_to_id(self.eos_token)] if self.eos_token else []
        eos += _id_list(gen.get("eos_token_id")) + _id_list(cfg.get("eos_token_id"))
        # Chat models often end turns with a token other than the tokenizer's eos; all of them stop generation.
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos if i is not None))
        if self.eos_token is None and self.eos_token_ids:
            self.eos_token = self._tok.id_to_token(self.eos_token_ids[0])
        # BOS comes from the post-processor when tokenizer.json has one that adds it; add_bos_token only
        # asks for it where the post-processor does not (the Llama-style configs), so it is never doubled.
        post_adds_bos = self.bos_token_id is not None and self._tok.encode("").ids[:1] == [self.bos_token_id]
        self._prepend_bos = bool(tc.get("add_bos_token")) and self.bos_token_id is not None and not post_adds_bos
        self.chat_template = self._find_chat_template(model_dir, tc)
        self._compiled_template: Template | None = None
        self.max_token_bytes = self._max_token_bytes()
        self.lossless = self._is_lossless()

    def _max_token_bytes(self) -> int:
        """The most UTF-8 bytes of input one token can stand for: the longest token, spelled as the vocabulary
        spells it or as it decodes, whichever is longer (byte-level BPE spells a byte in up to two bytes)."""
        n = self.vocab_size
        decoded = self._tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
        spelled = [self._tok.id_to_token(i) or "" for i in range(n)]
        return max(1, *(len(s.encode("utf-8", "surrogatepass")) for s in (*decoded, *spelled)))

    def _is_lossless(self) -> bool:
        ids = self._tok.encode(_LOSSLESS_PROBE, add_special_tokens=False).ids
        back = self._tok.decode(ids, skip_special_tokens=False)
        return back in (_LOSSLESS_PROBE, _LOSSLESS_PROBE[1:])  # a SentencePiece decoder drops the leading space

    def text_bound(self, max_tokens: int) -> int | None:
        """UTF-8 bytes beyond which a text cannot tokenize to fewer than `max_tokens` tokens: each token
        covers at most max_token_bytes of it. None when the tokenizer may drop text (the probe did not come
        back intact), so that no byte count says anything about the token count."""
        return max_tokens * self.max_token_bytes if self.lossless else None

    @staticmethod
    def _find_chat_template(model_dir: str, tc: dict) -> str | None:
        template = tc.get("chat_template")
        if isinstance(template, list):  # named templates: HF uses the one called "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = os.path.join(model_dir, "chat_template.jinja")  # newer HF saves it on its own
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        return template

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special-token text in it (e.g. chat markers) becomes those tokens.
        With add_special_tokens, BOS is added by the post-processor or, failing that, by add_bos_token."""
        if len(text) > RELEASE_GIL_ABOVE:
            ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if len(ids) > RELEASE_GIL_ABOVE:
            return self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_strs(self, ids: list[int]) -> list[str | None]:
        """Each id's token as the vocabulary spells it (None for an id outside it)."""
        return [self._tok.id_to_token(i) for i in ids]

    def set_chat_template(self, template: str) -> None:
        """`--chat-template`: a file holding a Jinja template, or the template itself (as vLLM takes it). Text
        without a brace or a newline is no template, so it names a file, which must be there: otherwise every
        chat would render as the path, dropping the messages."""
        if os.path.isfile(template):
            with open(template, encoding="utf-8") as f:
                template = f.read()
        elif not any(c in template for c in "{}\n"):
            raise ValueError(
                f"--chat-template {template}: no such file "
                "(a template given as text holds Jinja's {{ }} or {% %})"
            )
        self.chat_template, self._compiled_template = template, None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for a conversation. Like HF, the template writes its own special tokens (BOS
        included), so encode the result with add_special_tokens=False. Extra kwargs reach the template."""
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template; send a plain prompt (completions) instead, "
                "or add a chat_template to its tokenizer_config.json"
            )
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        return self._compiled_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )


def _compile_template(source: str) -> Template:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, indent=None):
        # jinja2's own tojson escapes HTML characters; templates written for HF expect plain JSON.
        return json.dumps(value, ensure_ascii=False, indent=indent)

    # A template comes with the model from anywhere, so it runs sandboxed; the options are those HF uses,
    # so templates render byte for byte as they do there.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = tojson
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns generated ids into text deltas for streaming.

    Each push decodes a short window of tokens twice, without and with the new ones, and emits the
    difference: decoding a suffix alone can differ from the same tokens inside the whole text (leading
    spaces, merged bytes). Text ending in U+FFFD is held back, since byte-level tokens may split a
    character. The last prompt tokens seed the window, unless they end in a split character themselves:
    then the generated text starts afresh, so the deltas always add up to decode(generated ids) for
    byte-level tokenizers. Call flush() at the end for a held-back tail.
    """

    CONTEXT_TOKENS = 5  # enough for any tokenizer's suffix effects seen in practice

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids[-self.CONTEXT_TOKENS :])
        self._prefix = 0  # window start
        self._read = len(self._ids)  # tokens before this have been emitted
        if self._decode(self._prefix, self._read).endswith(REPLACEMENT_CHAR):
            self._prefix = self._read
        self._text = ""

    def _decode(self, lo: int, hi: int | None = None) -> str:
        return self.tokenizer.decode(self._ids[lo:hi], skip_special_tokens=self.skip_special_tokens)

    @property
    def text(self) -> str:
        """All text emitted so far (held-back bytes excluded)."""
        return self._text

    def push(self, token_id: int) -> str:
        """Adds one generated token; returns the text it completes (possibly "")."""
        self._ids.append(token_id)
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix)
        if len(after) <= len(before) or after.endswith(REPLACEMENT_CHAR):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._text += delta
        return delta

    def flush(self) -> str:
        """Whatever push held back (e.g. an incomplete character at the end), as decode gives it."""
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix)
        delta = after[len(before) :] if len(after) > len(before) else ""
        self._prefix = self._read = len(self._ids)
        self._text += delta
        return delta


def find_stop(text: str, stops: list[str], start: int) -> int | None:
    """Index in `text` where the earliest of `stops` begins, or None. Only text from `start` on is new,
    so the search begins just far enough back for a stop string that straddles `start`."""
    stops = [s for s in stops if s]
    if not stops:
        return None
    lo = max(0, start - max(len(s) for s in stops) + 1)
    found = [i for i in (text.find(s, lo) for s in stops) if i >= 0]
    return min(found) if found else None
