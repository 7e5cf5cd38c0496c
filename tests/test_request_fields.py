"""Every field of vLLM's completion and chat request models (tests/fixtures/vllm_request_fields.json, recorded
from vLLM's source by tests/fixtures/record_vllm_request_fields.py) is implemented, accepted with no effect for
a stated reason, or refused with a 400 naming it; a field in neither is ignored with a warning and a count.
The whole list is checked at the protocol level; one refused and one unknown field go through the real API
server (uvicorn, the app, its guard) over a fake engine, with the request log on and off."""

from __future__ import annotations

import http.client
import json
import logging
import pathlib

import pytest
from http_servers import running

from afd.config.http_section import HttpSection
from afd.engine.request import RequestOutput
from afd.observability.attention_metrics import MAX_FIELD_LABELS, AttentionMetrics
from attention_node import request_fields
from attention_node.openai_protocol import ApiError, ChatCompletionRequest, CompletionRequest, Limits, sampling_params

FIXTURE = json.loads((pathlib.Path(__file__).parent / "fixtures" / "vllm_request_fields.json").read_text())
MODELS = {"completion": CompletionRequest, "chat": ChatCompletionRequest}
BASE = {"completion": {"prompt": [1, 2, 3]}, "chat": {"messages": [{"role": "user", "content": "hi"}]}}
LIMITS = Limits(max_model_len=64, vocab_size=100)
SAMPLES = {  # a value other than vLLM's default, where the type alone does not give one
    "prompt": "hello",
    "messages": [{"role": "user", "content": "hello"}],
    "stop": ["x"],
    "stream_options": {"include_usage": True},
    "logit_bias": {"1": 1.0},
    "top_logprobs": 2,
    "truncation_side": "right",
    "request_id": "abc",
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "auto",
    "response_format": {"type": "json_object"},
    "structured_outputs": {"regex": "a+"},
    "reasoning_effort": "low",
    "mm_payload": "none",
    "prompt_embeds": "AAAA",
    "documents": [{"title": "t", "text": "x"}],
    "repetition_detection": {"max_pattern_size": 2},
    "thinking_token_budget": 10,
    "skip_special_tokens": False,  # unset means true
}
COMPANIONS = {"top_logprobs": {"logprobs": True}}
"""Fields that take effect only with another one set."""


def _sample(name: str, spec: dict):
    if name in SAMPLES:
        return SAMPLES[name]
    default, typ = spec.get("default"), spec["type"].removesuffix(" | None")
    if isinstance(default, bool):
        return not default
    for prefix, value in (("bool", True), ("list[int]", [1]), ("list[str]", ["x"]), ("dict", {"k": "v"})):
        if typ.startswith(prefix):
            return value
    if typ.startswith("float"):
        return 0.5
    if typ.startswith(("int", "Annotated[int")):
        return (default or 1) + 1
    if typ.startswith("str"):
        return "x"
    raise AssertionError(f"no sample value for {name} ({typ}): add one to SAMPLES")


def _cases():
    return [(ep, name, spec) for ep, fields in FIXTURE["models"].items() for name, spec in fields.items()]


def test_the_fixture_is_vllms_and_the_table_places_every_field():
    assert FIXTURE["vllm_version"] == "0.33.0" and FIXTURE["vllm_commit"]
    for ep, fields in FIXTURE["models"].items():
        assert FIXTURE["sources"][ep]["path"].startswith("vllm/entrypoints/openai/")
        placed = set(request_fields.RULES[ep]) | set(request_fields.STRUCTURED)
        assert not set(fields) - placed, f"vLLM's {ep} fields afd has not placed"
        # afd's own model declares nothing vLLM lacks but OpenAI's legacy best_of
        assert set(MODELS[ep].model_fields) - set(fields) <= {"best_of"}
        assert set(request_fields.RULES[ep]) - set(fields) <= {"best_of"}, "a rule for a field vLLM no longer has"
        for rule in request_fields.RULES[ep].values():
            assert rule.kind in ("implemented", "ignored", "refused") and (rule.kind == "implemented" or rule.why)


@pytest.mark.parametrize("ep,name,spec", _cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_a_non_default_value_is_taken_or_refused_naming_the_field(ep, name, spec):
    body = {**BASE[ep], **COMPANIONS.get(name, {}), name: _sample(name, spec)}
    req = MODELS[ep].model_validate(body)
    rule = request_fields.RULES[ep].get(name)
    if rule is None or rule.kind == "refused":
        with pytest.raises(ApiError) as e:
            request_fields.check(req, ep == "chat")
        assert e.value.code == 400 and e.value.param == name and name in e.value.message
        return
    assert request_fields.check(req, ep == "chat") == []  # taken, and not counted as unknown
    if rule.kind == "implemented":
        assert name in req.model_fields_set  # afd's model reads it (its effect: the tests below and the API's)
        sampling_params(req, 0, LIMITS)


@pytest.mark.parametrize("ep,name,spec", [c for c in _cases() if "default" in c[2]], ids=lambda x: x)
def test_vllms_default_is_off(ep, name, spec):
    if name not in BASE[ep]:
        req = MODELS[ep].model_validate({**BASE[ep], name: spec["default"]})
        assert request_fields.check(req, ep == "chat") == []


def test_off_values_of_structured_fields_pass_and_a_field_of_no_model_is_returned():
    req = ChatCompletionRequest.model_validate(
        {**BASE["chat"], "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "foo_bar": 1}
    )
    assert request_fields.check(req, chat=True) == ["foo_bar"]
    req = ChatCompletionRequest.model_validate({**BASE["chat"], "suffix": "x", "prompt": "y"})
    assert request_fields.check(req, chat=True) == ["suffix", "prompt"]  # completion fields: vLLM ignores them
    zeros = {"min_p": 0.0, "priority": 0, "length_penalty": 1, "skip_special_tokens": True, "tool_choice": None}
    assert request_fields.check(CompletionRequest.model_validate({**BASE["completion"], **zeros}), chat=False) == []
    req = CompletionRequest.model_validate({**BASE["completion"], "min_p": 0.0, "priority": 0, "use_beam_search": 0})
    with pytest.raises(ApiError, match="use_beam_search"):  # 0 is not False: off values match by type
        request_fields.check(req, chat=False)


def test_truncate_keeps_the_last_tokens_as_vllm():
    def cut(ids, n, side=None):
        body = CompletionRequest(prompt=ids, truncate_prompt_tokens=n, truncation_side=side)
        return request_fields.truncate(ids, body, 8)

    ids = list(range(20))
    assert cut(ids, None) == ids and cut(ids, 3) == [17, 18, 19] and cut(ids, 3, "right") == [0, 1, 2]
    assert cut(ids, -1) == ids[-7:] and cut([1, 2], 5) == [1, 2]
    with pytest.raises(ApiError, match="truncate_prompt_tokens=9 cannot be greater than max_model_len = 8"):
        cut(ids, 9)


def test_output_edits_add_the_stop_string_and_the_chat_echo():
    edit = request_fields.OutputEdit("Once", stop_str=True)
    first, last = RequestOutput("r", [1], " upon"), RequestOutput("r", [2], " a", True, "stop", "time")
    assert edit(first).new_text == "Once upon" and edit(last).new_text == " atime"
    assert request_fields.OutputEdit(stop_str=True)(RequestOutput("r", [2], "x", True, "stop", 2)).new_text == "x"
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "text", "text": "A:"}]}]
    assert request_fields.chat_echo(ChatCompletionRequest(messages=msgs, echo=True)) == "A:"
    assert request_fields.chat_echo(ChatCompletionRequest(messages=msgs[:1], echo=True)) == ""
    assert request_fields.chat_echo(ChatCompletionRequest(messages=msgs[:1], echo=True, add_generation_prompt=False))
    assert request_fields.chat_echo(ChatCompletionRequest(messages=msgs)) == ""


def test_the_ignored_field_counter_bounds_its_labels():
    m = AttentionMetrics("a0", "m")
    for i in range(MAX_FIELD_LABELS + 5):
        m.ignored_field(f"f{i}")
    m.ignored_field("f0")
    m.ignored_field("bad name{}")
    text = m.render().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("afd_ignored_request_fields_total")]
    assert len(lines) == MAX_FIELD_LABELS + 1
    assert any('field="f0"' in ln and ln.endswith(" 2.0") for ln in lines)
    assert any('field="other"' in ln and ln.endswith(" 6.0") for ln in lines)


# ---- through the real API server ---------------------------------------------------------------------------


class _Engine:
    """Answers every request at once with one token."""

    dead = paused = None

    def add_request(self, r):
        r.on_output(RequestOutput(r.request_id, [7], "", True, "length", num_prompt_tokens=len(r.prompt_ids)))

    def abort(self, rid):
        pass


def _post(port: int, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def _get(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path)
    text = conn.getresponse().read().decode()
    conn.close()
    return text


@pytest.mark.parametrize("log_requests", [True, False])
def test_the_api_refuses_counts_and_logs(caplog, log_requests):
    from attention_node.api_server import ServerState, build_app

    metrics = AttentionMetrics("a0", "m")
    st = ServerState(_Engine(), None, "m", "/m", LIMITS, metrics, ready=lambda: True, log_requests=log_requests)
    caplog.set_level(logging.INFO, logger="afd.api")
    with running(HttpSection(), build_app(st)) as port:
        code, body = _post(port, {"prompt": [1, 2], "priority": 5})
        assert code == 400 and body["error"]["param"] == "priority" and "priority" in body["error"]["message"]
        code, body = _post(port, {"prompt": [1, 2, 3], "foo_bar": 1, "max_tokens": 1}, {"X-Request-Id": "abc"})
        assert code == 200 and body["choices"][0]["finish_reason"] == "length"
        assert body["id"] == "cmpl-abc"  # the response names the request as its log line does
        assert 'afd_ignored_request_fields_total{field="foo_bar"' in _get(port, "/metrics")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cmpl-abc" in warnings[0] and "'foo_bar'" in warnings[0]
    received = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Received request")]
    if log_requests:  # the refused request is not logged: it never reached the engine, as in vLLM
        assert len(received) == 1 and received[0].startswith("Received request cmpl-abc-0: params: SamplingParams(n=1")
        assert "max_tokens=1" in received[0] and received[0].endswith("lora_request: None.")
    else:
        assert received == []


def test_a_logged_request_cannot_forge_lines_or_flood_the_log(caplog):
    """A client's request id with a newline and an ANSI escape is written escaped; a vocabulary-wide stop list and
    logit_bias are cut, saying how much (unbounded, 3M stop ids made 20 MB log lines)."""
    from attention_node.api_server import ServerState, build_app

    st = ServerState(_Engine(), None, "m", "/m", LIMITS, None, ready=lambda: True, log_requests=True)
    caplog.set_level(logging.INFO, logger="afd.api")
    forged = "x\n2026-12-07 INFO afd.api Received request admin\x1b[2J"
    body = {
        "prompt": [1, 2, 3],
        "max_tokens": 1,
        "request_id": forged,
        "stop_token_ids": list(range(LIMITS.vocab_size)),
        "logit_bias": {str(i): 1.0 for i in range(LIMITS.vocab_size)},
    }
    with running(HttpSection(), build_app(st)) as port:
        code, out = _post(port, body)
    assert code == 200, out
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Received request")]
    assert len(lines) == 1 and "\n" not in lines[0] and "\x1b" not in lines[0], lines
    assert "cmpl-x\\n2026-12-07" in lines[0] and "\\x1b[2J" in lines[0]
    assert f"... {LIMITS.vocab_size} items]" in lines[0] and len(lines[0]) < 8 * 1024, len(lines[0])
    assert out["id"] == "cmpl-x\\n2026-12-07 INFO afd.api Received request admin\\x1b[2J"


def test_requests_are_logged_unless_vllms_opt_out_flags_say_not(capsys):
    import yaml

    from afd.entrypoints.cli import main

    def engine(*argv: str) -> dict:
        assert main(["serve", "demo", "--print-config", *argv]) == 0
        return yaml.safe_load(capsys.readouterr().out).get("engine", {})

    assert engine().get("enable_log_requests", True) is True  # on, as the issue asks (vLLM 0.33 made it opt-in)
    assert engine("--no-enable-log-requests")["enable_log_requests"] is False
    assert engine("--disable-log-requests")["enable_log_requests"] is False


def test_the_big_body_check_says_truncation_does_not_reach_it():
    from attention_node.body_check import verdict

    body = json.dumps({"prompt": list(range(70)), "truncate_prompt_tokens": 8}).encode()
    assert "truncate_prompt_tokens does not apply" in verdict(body, 64, 100)["error"]["message"]
    plain = verdict(json.dumps({"prompt": list(range(70))}).encode(), 64, 100)
    assert "truncate_prompt_tokens" not in plain["error"]["message"]


def _demo_tokenizer():
    from afd.engine.tokenizer import load_tokenizer
    from afd.model.demo import ensure_demo_checkpoint

    return load_tokenizer(ensure_demo_checkpoint())


def test_add_special_tokens_and_the_templates_own_variables():
    import asyncio

    from attention_node import prompts
    from attention_node.openai_protocol import ChatMessage

    tok = _demo_tokenizer()
    limits = Limits(max_model_len=4096, vocab_size=tok.vocab_size)
    with_bos = asyncio.run(prompts.completion_prompts(tok, "Experts are", limits))[0]
    plain = asyncio.run(prompts.completion_prompts(tok, "Experts are", limits, add_special_tokens=False))[0]
    assert with_bos == tok.encode("Experts are", True) and plain == with_bos[1:]  # the demo's BOS, or not
    tok.chat_template = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{{ flavour | default('') }}"
    tok._compiled_template = None
    msgs = [ChatMessage(role="user", content="hi")]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    ids = asyncio.run(prompts.chat_ids(tok, msgs, True, limits, template_kwargs={"flavour": "salty"}, tools=tools))
    assert tok.decode(ids) == "[get_weather]salty"  # the model sees the functions it may call, as in vLLM
    with pytest.raises(ApiError, match="chat_template_kwargs may not set messages"):
        asyncio.run(prompts.chat_ids(tok, msgs, True, limits, template_kwargs={"messages": []}))


def test_skip_special_tokens_false_keeps_them_in_the_text():
    """vLLM's skip_special_tokens: the request's text shows special tokens only when it is false (the ids
    keep them either way)."""
    from afd.engine.output_processor import OutputProcessor
    from afd.engine.request import Request
    from afd.engine.sampling import SamplingParams

    tok = _demo_tokenizer()
    body = CompletionRequest.model_validate({"prompt": [42], "skip_special_tokens": False})
    texts = {}
    for skip in (True, False):
        req = Request(str(skip), [42], SamplingParams(), 4, lambda o: None, skip_special_tokens=skip)
        OutputProcessor(None, None, tok, (2,), 64).add(req)  # type: ignore[arg-type]
        texts[skip] = "".join(req.detok.push(t) for t in (1, 93))
    assert texts == {True: "x", False: "<s>x"} and body.skip_special_tokens is False
