"""The prompts `afd.LLM.generate()` and `chat()` take, in the forms vLLM's LLM takes them (vLLM's
PromptType: a string, {"prompt": str}, {"prompt_token_ids": [...]}, or a list of these; read, not copied),
plus afd's earlier forms (a list of token ids, or a list of such lists)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from afd.engine.offline import OfflineRequest
from afd.engine.tokenizer import Tokenizer
from afd.entrypoints.llm_params import SamplingParams


@dataclass
class Prompt:
    text: str | None
    """None when given as token ids alone."""
    ids: list[int]


def prompts_of(prompts, tok: Tokenizer | None) -> list[Prompt]:
    """One Prompt per prompt given, text tokenized (with BOS where the tokenizer adds it)."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts: a string, a dict with prompt or prompt_token_ids, token ids, or a non-empty list")
    return [_one(p, i, tok) for i, p in enumerate(prompts)]


def _one(p, i: int, tok: Tokenizer | None) -> Prompt:
    if isinstance(p, dict):
        unknown = set(p) - {"prompt", "prompt_token_ids"}
        if unknown:
            raise ValueError(f"prompt {i}: afd does not take {', '.join(sorted(unknown))} (only text prompts)")
        if "prompt_token_ids" in p:
            return Prompt(p.get("prompt"), list(p["prompt_token_ids"]))
        if "prompt" not in p:
            raise ValueError(f"prompt {i}: a dict needs prompt or prompt_token_ids")
        p = p["prompt"]
    if isinstance(p, str):
        if tok is None:
            raise ValueError("this model has no tokenizer.json: give prompts as token ids")
        return Prompt(p, tok.encode(p))
    if isinstance(p, (list, tuple)):
        return Prompt(None, list(p))
    raise ValueError(f"prompt {i}: {type(p).__name__} is not a prompt (a string, a dict or token ids)")


def conversations_of(messages) -> list[list[dict]]:
    """One conversation (a list of messages) or a list of them -> a list of conversations."""
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
        return [messages]
    if not isinstance(messages, list) or not messages or not all(isinstance(c, list) and c for c in messages):
        raise ValueError("messages: a conversation (a list of message dicts) or a non-empty list of them")
    return messages


def render(
    tok: Tokenizer | None,
    conversation: list[dict],
    chat_template: str | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    kwargs: dict,
) -> Prompt:
    """A conversation through the chat template (`chat_template`: a template or a file holding one, over
    the tokenizer's), as the server renders it: text parts joined, the template writing its own BOS."""
    if tok is None:
        raise ValueError("chat() needs the model's tokenizer (tokenizer.json) and a chat template")
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message and add_generation_prompt exclude each other (as in vLLM)")
    if chat_template is not None:
        tok = copy.copy(tok)  # the LLM's own tokenizer keeps its template
        tok.set_chat_template(chat_template)
    msgs = [_message(m) for m in conversation]
    text = tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, **kwargs)
    if continue_final_message:  # the text ends where the last message's content does: the model goes on with it
        last = msgs[-1].get("content") or ""
        end = text.rfind(last)
        if not last or end < 0:
            raise ValueError("continue_final_message: the last message's content is not in the rendered prompt")
        text = text[: end + len(last)]
    return Prompt(text, tok.encode(text, add_special_tokens=False))


def _message(m: dict) -> dict:
    if not isinstance(m, dict) or "role" not in m:
        raise ValueError(f"a message is a dict with a role, got {m!r}")
    content = m.get("content")
    if isinstance(content, list):
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise ValueError('afd takes text content parts only ({"type": "text", "text": ...})')
        m = {**m, "content": "\n".join(p["text"] for p in content)}
    return m


def requests_of(
    prompts: list[Prompt], params: list[SamplingParams], max_model_len: int
) -> tuple[list[OfflineRequest], list[tuple[int, int]]]:
    """The engine's sequences of the prompts: n per prompt, output j of a seeded prompt sampled with seed + j
    (as the server's choices), max_tokens cut to the context limit (vLLM's max_model_len: a prompt that
    reaches it is refused); and (prompt, output index) per sequence."""
    requests, owner = [], []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        if len(p.ids) >= max_model_len:
            raise ValueError(f"prompt {i}: {len(p.ids)} tokens leave no room under max_model_len {max_model_len}")
        max_tokens = min(sp.max_tokens or max_model_len, max_model_len - len(p.ids))
        for j in range(sp.n):
            seed = None if sp.seed is None else sp.seed + j
            requests.append(
                OfflineRequest(
                    p.ids, max_tokens, sp.engine_params(seed), sp.stop_strings, sp.ignore_eos, sp.skip_special_tokens
                )
            )
            owner.append((i, j))
    return requests, owner
