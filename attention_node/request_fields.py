"""Every field of vLLM's completion and chat request models, and what afd does with it: implemented, accepted
with no effect (and why that is honest), or refused with a 400 naming it when set to anything but its "off"
value (vLLM's default). A field in neither model is ignored, as vLLM ignores it, but never silently: the API
server logs it and counts it (afd_ignored_request_fields_total).

The lists are vLLM 0.33.0's CompletionRequest and ChatCompletionRequest (vllm/entrypoints/openai/
{completion,chat_completion}/protocol.py), recorded in tests/fixtures/vllm_request_fields.json, which
tests/test_request_fields.py holds this table to: a new vLLM field fails that test until it is placed here.
"""

from __future__ import annotations

from dataclasses import dataclass

from attention_node.openai_protocol import ApiError


@dataclass(frozen=True)
class Rule:
    kind: str
    """implemented | ignored (accepted, no effect: `why` says why that is honest) | refused"""
    why: str = ""
    off: tuple = ()
    """Values a refused field may take (null always may: it means unset)."""


def _impl(why: str = "") -> Rule:
    return Rule("implemented", why)


def _ignored(why: str) -> Rule:
    return Rule("ignored", why)


def _refused(why: str, *off) -> Rule:
    return Rule("refused", why, off)


_NO_RENDER = "vLLM honours it on its /render endpoints only and ignores it when generating, as afd does"
_MM = "the served models take text only"

COMMON = {
    "model": _impl(),
    "frequency_penalty": _impl(),
    "logit_bias": _impl(),
    "logprobs": _impl(),
    "max_tokens": _impl(),
    "n": _impl(),
    "presence_penalty": _impl(),
    "seed": _impl(),
    "stop": _impl(),
    "stream": _impl(),
    "stream_options": _impl("include_usage; continuous_usage_stats is refused"),
    "temperature": _impl(),
    "top_p": _impl(),
    "top_k": _impl(),
    "repetition_penalty": _impl(),
    "stop_token_ids": _impl(),
    "ignore_eos": _impl(),
    "min_tokens": _impl(),
    "return_token_ids": _impl(),
    "echo": _impl("completions: the prompt's text first; chat: the last message's content, as vLLM"),
    "include_stop_str_in_output": _impl("the stop string that ended a choice ends its text"),
    "truncate_prompt_tokens": _impl("keeps the last N prompt tokens (-1: max_model_len - 1), as vLLM"),
    "truncation_side": _impl("right keeps the first N tokens instead"),
    "request_id": _impl("names the request in the request log (cmpl-ID / chatcmpl-ID, as vLLM)"),
    "best_of": _impl("OpenAI's legacy field (not in vLLM 0.33): only best_of = n"),
    "user": _ignored("OpenAI's end-user id for abuse monitoring; vLLM ignores it too"),
    "session_id": _ignored("an identity shared by related requests, for routers and KV connectors; afd has neither"),
    "spaces_between_special_tokens": _ignored(
        "afd decodes with the fast (Rust) tokenizer, whose decode has no such option; vLLM's fast detokenizer "
        "ignores it too (vllm/v1/engine/detokenizer.py)"
    ),
    "return_token_offsets": _ignored(_NO_RENDER),
    "mm_payload": _ignored(_NO_RENDER),
    "return_mm_kwargs": _ignored(_NO_RENDER),
    "use_beam_search": _refused("beam search is not implemented", False),
    "min_p": _impl(),
    "watermarking": _refused("there is no watermarking", False),
    "length_penalty": _refused("only beam search uses it, and there is none", 1),
    "skip_special_tokens": _impl(),
    "allowed_token_ids": _refused("restricting sampling to a set of tokens is not implemented"),
    "prompt_logprobs": _refused("prompt logprobs are not computed"),
    "logprob_token_ids": _refused("logprobs of chosen token ids are not returned"),
    "bad_words": _refused("bad-word bans are not implemented", []),
    "priority": _refused(
        "the scheduler serves requests first come, first served (vLLM too refuses a non-zero priority "
        "without priority scheduling)",
        0,
    ),
    "return_tokens_as_token_ids": _refused("logprob tokens are always given as text", False),
    "return_weight_versions": _refused("weights are not versioned", False),
    "routed_experts_prompt_start": _refused("routed-expert data is not returned", 0),
    "cache_salt": _refused("there is no prefix cache to salt yet"),
    "kv_transfer_params": _refused("there is no KV-transfer connector", {}),
    "ec_transfer_params": _refused("there is no encoder-cache connector", {}),
    "vllm_xargs": _refused("no extension takes extra arguments", {}),
    "repetition_detection": _refused("repetition detection is not implemented"),
    "thinking_token_budget": _refused("there is no reasoning parser to bound thinking with", -1),
    "stream_interval": _refused("every engine step's tokens are streamed as they come", 1),
}
COMPLETION = {
    "prompt": _impl(),
    "suffix": _refused("insertion (a suffix after the completion) is not supported", ""),
    "prompt_embeds": _refused("prompts are text or token ids, not embeddings"),
    "add_special_tokens": _impl("a text prompt's tokenization"),
}
CHAT = {
    "messages": _impl(),
    "top_logprobs": _impl(),
    "max_completion_tokens": _impl(),
    "add_generation_prompt": _impl(),
    "add_special_tokens": _impl("the rendered conversation's tokenization"),
    "reasoning_effort": _refused("there are no reasoning controls for the chat template"),
    "include_reasoning": _refused("there is no reasoning parser to split reasoning from the answer", True),
    "return_prompt_text": _refused("the rendered chat template's text is not returned", False),
    "continue_final_message": _refused("continuing the final message is not implemented", False),
    "documents": _refused("documents are not passed to the chat template", []),
    "chat_template": _refused("the server's chat template (model.chat_template) is the only one", ""),
    "chat_template_kwargs": _impl("variables for the chat template"),
    "media_io_kwargs": _refused(_MM, {}),
    "mm_processor_kwargs": _refused(_MM, {}),
}

_SO = "structured outputs (attention_node/structured.py)"
COMMON |= {"response_format": _impl(_SO), "structured_outputs": _impl(_SO)}
CHAT |= {
    "tools": _impl("constrained calls: tool_choice required or a named function (auto is refused)"),
    "tool_choice": _impl("none, required or a named function; auto is refused: there is no tool parser"),
    "parallel_tool_calls": _impl("false: tool_choice required makes one call"),
}
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_whitespace_pattern")
"""vLLM's older names for structured outputs: vLLM 0.33's models no longer have them and it ignores them with a
warning (_REMOVED_GUIDED_FIELDS, vllm/entrypoints/serve/engine/protocol.py); afd takes them, as the issue asks
(attention_node/structured.py reads them from the extra fields), on either endpoint."""

STRUCTURED = {
    # chat's tool fields on /v1/completions (vLLM's completion model has none of them)
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (True,),
    "guided_decoding_backend": (),  # afd has one grammar engine (llguidance) and no choice of another
    "structural_tag": (),
}
"""Structured-output fields refused where the endpoint does not implement them: field -> its off values."""

RULES = {"completion": {**COMMON, **COMPLETION}, "chat": {**COMMON, **CHAT}}
"""Per endpoint, every field afd knows but the structured ones."""

_UNSET = object()


def _value(body, name: str):
    if name in type(body).model_fields:
        return getattr(body, name)
    return (body.model_extra or {}).get(name, _UNSET)


def _is_off(value, off: tuple) -> bool:
    # `==` would take 0 for False and 1.0 for True: off values match by type and value
    return (
        value is _UNSET
        or value is None
        or any(type(value) is type(o) and value == o for o in off)
        or (isinstance(value, float) and any(type(o) is int and value == o for o in off))
    )


def check(body, chat: bool) -> list[str]:
    """400 for the first refused or structured field set to anything but off; returns the names of the
    fields neither vLLM's model nor afd knows (for the caller to log and count)."""
    rules = RULES["chat" if chat else "completion"]
    for name, off in STRUCTURED.items():
        if name in rules:  # implemented on this endpoint
            continue
        value = _value(body, name)
        if not _is_off(value, off):
            raise ApiError(400, f"{name} is not supported by this server yet.", name)
    for name, rule in rules.items():
        if rule.kind == "refused" and not _is_off(_value(body, name), rule.off):
            raise ApiError(400, f"{name} is not supported by this server: {rule.why}.", name)
    opts = getattr(body, "stream_options", None)
    if opts is not None and opts.continuous_usage_stats:
        param = "stream_options.continuous_usage_stats"
        raise ApiError(400, f"{param} is not supported by this server: usage comes in the last chunk only.", param)
    return [k for k in (body.model_extra or {}) if k not in rules and k not in STRUCTURED and k not in GUIDED]


# ---- the effects of the fields implemented here (the others are read where they act) ----------------------


def truncate(ids: list[int], body, max_model_len: int) -> list[int]:
    """truncate_prompt_tokens as vLLM applies it (vllm/renderers/params.py, TokenizeParams): keep N tokens of
    the tokenized prompt, the last N unless truncation_side is right (vLLM's generate tokenizers truncate on
    the left); -1 means max_model_len - 1, which leaves room for one output token; more than
    max_model_len is a 400."""
    n = body.truncate_prompt_tokens
    if n is None:
        return ids
    if n > max_model_len:
        raise ApiError(
            400,
            f"truncate_prompt_tokens={n} cannot be greater than max_model_len = {max_model_len}. "
            "Please request a smaller truncation size.",
            "truncate_prompt_tokens",
        )
    if n < 0:
        n = max_model_len - 1
    if n >= len(ids):
        return ids
    return ids[:n] if body.truncation_side == "right" else ids[len(ids) - n :]


def chat_echo(body) -> str:
    """Chat's `echo`: the last message's content when it has the response's role (assistant; with
    add_generation_prompt false, the last message's own role), as vLLM's serving_chat prepends it."""
    if not getattr(body, "echo", False) or not body.messages:
        return ""
    last = body.messages[-1]
    if body.add_generation_prompt and last.role != "assistant":
        return ""
    if isinstance(last.content, list):
        return "\n".join(p.get("text", "") for p in last.content if isinstance(p, dict))
    return last.content or ""


@dataclass
class OutputEdit:
    """Applied to each output of one choice before the API sees it (on the engine thread, in the request's
    callback), so the full and the streamed response agree."""

    prefix: str = ""
    """Chat echo: put before the first text, once."""
    stop_str: bool = False
    """include_stop_str_in_output: the stop string that ended the choice is added after its text."""

    def __call__(self, out):
        if self.prefix and out.error is None:
            out.new_text, self.prefix = self.prefix + out.new_text, ""
        if self.stop_str and out.finish_reason == "stop" and isinstance(out.stop_reason, str):
            out.new_text += out.stop_reason
        return out
