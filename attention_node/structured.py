"""Structured outputs on the OpenAI API: a request's fields -> one grammar (afd.engine.grammar), compiled on a
worker thread before the request enters the engine, and the tool calls a constrained chat answer becomes.

The fields, as vLLM takes them (docs.vllm.ai, "Structured Outputs" and "Tool Calling"; vllm/sampling_params.py
StructuredOutputsParams; vllm/entrypoints/openai/protocol.py):
- `response_format`: {"type": "text"} (no constraint), {"type": "json_object"}, {"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}; "structural_tag" is refused.
- `structured_outputs`: exactly one of json, regex, choice, grammar, json_object; the options
  disable_any_whitespace, whitespace_pattern, disable_additional_properties and disable_fallback (afd has one
  engine and nothing to fall back to); structural_tag and unknown keys are refused, named.
- the older guided_json, guided_regex, guided_choice, guided_grammar and guided_whitespace_pattern.
- chat's `tools` with `tool_choice`: "none" (tools ignored), "required" (an array of calls, each {"name",
  "parameters"} of one of the tools) or {"type": "function", "function": {"name"}} (that function's
  parameters); "auto", also the default when tools are given, is refused: it needs a tool parser for the
  model's own tool-call format, and afd has none yet. parallel_tool_calls false allows one call.
A request takes at most one constraint; an invalid schema, regex or grammar is a 400 naming the field.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass

from afd.engine.grammar import Grammar, GrammarCompiler, GrammarError, GrammarSpec
from attention_node.openai_protocol import ApiError

SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")
SO_OPTIONS = ("disable_any_whitespace", "whitespace_pattern", "disable_additional_properties", "disable_fallback")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass(frozen=True)
class Constraint:
    spec: GrammarSpec
    param: str
    """The request field it came from (named in a 400)."""
    tool: str | None = None
    """The function a named tool_choice calls; "" for tool_choice "required"; None: not a tool call."""


def constraint_of(body, chat: bool) -> Constraint | None:
    """The request's one constraint, or None; 400 for anything malformed, unsupported or doubled."""
    found: list[Constraint] = []
    rf = getattr(body, "response_format", None)
    if rf is not None:
        c = _response_format(rf)
        if c is not None:
            found.append(c)
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        found.append(_structured_outputs(so))
    for name, kind in GUIDED.items():
        value = getattr(body, name, None)
        if value is not None:
            ws = getattr(body, "guided_whitespace_pattern", None)
            found.append(Constraint(_spec(kind, value, name, whitespace_pattern=ws), name))
    if chat:
        c = _tools(body)
        if c is not None:
            found.append(c)
    if len(found) > 1:
        raise ApiError(
            400, f"Only one constraint per request: got {', '.join(c.param for c in found)}.", found[1].param
        )
    return found[0] if found else None


def _response_format(rf) -> Constraint | None:
    if not isinstance(rf, dict) or "type" not in rf:
        raise ApiError(400, 'response_format must be an object with a "type".', "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(GrammarSpec("json_object"), "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("name"), str):
            raise ApiError(
                400, 'response_format json_schema needs "json_schema": {"name", "schema"}.', "response_format"
            )
        schema = js.get("schema", {})  # OpenAI's is optional: then any JSON value
        return Constraint(_spec("json", schema, "response_format.json_schema.schema"), "response_format")
    raise ApiError(
        400,
        f"response_format type {kind!r} is not supported by this server; use text, json_object or json_schema.",
        "response_format",
    )


def _structured_outputs(so) -> Constraint:
    param = "structured_outputs"
    if not isinstance(so, dict):
        raise ApiError(400, "structured_outputs must be an object.", param)
    unknown = [k for k in so if k not in SO_KINDS + SO_OPTIONS]
    if unknown:
        raise ApiError(
            400, f"structured_outputs: {', '.join(unknown)} not supported by this server.", f"{param}.{unknown[0]}"
        )
    kinds = [k for k in SO_KINDS if so.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise ApiError(400, f"structured_outputs needs exactly one of {', '.join(SO_KINDS)}; got {len(kinds)}.", param)
    kind = kinds[0]
    spec = _spec(
        kind,
        None if kind == "json_object" else so[kind],
        f"{param}.{kind}",
        any_whitespace=not so.get("disable_any_whitespace", False),
        whitespace_pattern=so.get("whitespace_pattern"),
        no_additional_properties=bool(so.get("disable_additional_properties", False)),
    )
    return Constraint(spec, param)


def _spec(kind: str, value, param: str, **options) -> GrammarSpec:
    """A spec with its value's type checked (its content is checked by compiling it)."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ApiError(400, f"{param} is not valid JSON: {e}", param) from None
        if not isinstance(value, (dict, bool)):
            raise ApiError(400, f"{param} must be a JSON schema (an object).", param)
    elif kind in ("regex", "grammar") and not (isinstance(value, str) and value):
        raise ApiError(400, f"{param} must be a non-empty string.", param)
    elif kind == "choice" and not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
        raise ApiError(400, f"{param} must be a non-empty list of non-empty strings.", param)
    if options.get("whitespace_pattern") is not None and not isinstance(options["whitespace_pattern"], str):
        raise ApiError(400, f"{param}: whitespace_pattern must be a string.", param)
    return GrammarSpec(kind, value, **options)


def _tools(body) -> Constraint | None:
    tools, choice = getattr(body, "tools", None), getattr(body, "tool_choice", None)
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools.", "tool_choice")
        return None
    functions = {}
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if t.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, 'Each tool must be {"type": "function", "function": {"name", "parameters"}}.', "tools")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        functions[fn["name"]] = _spec("json", params, f"tools.{fn['name']}.parameters").value
    if choice is None or choice == "auto":
        raise ApiError(
            400,
            'tool_choice "auto" (the default when tools are given) needs a tool parser for this model\'s tool-call '
            'format, and afd has none yet; use "required", a named function or "none".',
            "tool_choice",
        )
    if choice == "none":
        return None
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in functions.items()
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if getattr(body, "parallel_tool_calls", None) is False:
            schema["maxItems"] = 1
        return Constraint(GrammarSpec("json", schema), "tool_choice", tool="")
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ApiError(
            400,
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name"}}.',
            "tool_choice",
        )
    if name not in functions:
        raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools.", "tool_choice")
    return Constraint(GrammarSpec("json", functions[name]), "tool_choice", tool=name)


async def compile_for(st, c: Constraint) -> Grammar:
    """The constraint compiled on a worker thread (never the engine's, never the event loop's); 400 if invalid."""
    if st.tokenizer is None:
        raise ApiError(400, "Structured outputs need a tokenizer; this model has no tokenizer.json.", c.param)
    if getattr(st, "grammars", None) is None:
        path = os.path.join(st.model_path, "tokenizer.json")
        st.grammars = GrammarCompiler(path, st.limits.vocab_size, st.engine.eos_ids)
    try:
        return await st.grammars.compile_async(c.spec, st.max_grammar_bytes)
    except GrammarError as e:
        raise ApiError(400, f"Invalid {c.param}: {e}", c.param) from None


def tool_calls(c: Constraint, text: str) -> list[dict] | None:
    """The OpenAI tool_calls a constrained answer stands for; None when the text is not whole (cut by
    max_tokens)."""
    if c.tool is None:
        return None
    if c.tool:
        calls = [(c.tool, text)]
    else:
        try:
            calls = [(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in json.loads(text)]
        except (ValueError, KeyError, TypeError):
            return None
    return [tool_call(name, args) for name, args in calls]


def tool_call(name: str, arguments: str) -> dict:
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
