"""Structured outputs through the official OpenAI client at 1A1F: JSON that validates against the
schema from the demo model and from a tiny DeepSeek-V3, tool calls with valid arguments, regex, choice and
grammar; unconstrained requests batched with constrained ones keep their greedy tokens; what is invalid or
unsupported is a 400. The models are random: the grammar alone makes the output valid, and the schemas are
bounded (maxLength, enums, integer ranges, no additional properties) so that it also finishes."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema  # pyproject's test extra: kubernetes-validate depends on it
import openai
import pytest
from cluster_helpers import Cluster, cluster_yaml

pytestmark = pytest.mark.multiprocess

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather now", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]
MAX = 500  # room for the bounded whitespace a random model takes between JSON tokens
HI = [{"role": "user", "content": "Describe a person as JSON."}]


def _serve(tmp, model_path: str):
    c = Cluster(cluster_yaml(tmp, model_path, name="so"))
    c.start_all()
    c.wait_ready()
    return c


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    c = _serve(tmp_path_factory.mktemp("so"), "demo")
    try:
        client = openai.OpenAI(base_url=c.url() + "/v1", api_key="none", max_retries=0, timeout=120)
        yield client, client.models.list().data[0].id
    finally:
        c.stop()


def _json_schema(client, model, **kw):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    return client.chat.completions.create(model=model, messages=HI, response_format=fmt, max_tokens=MAX, **kw)


def test_json_schema_from_the_demo_validates(demo):
    client, model = demo
    r = _json_schema(client, model, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    # n choices sampled: each advances its own copy of the grammar
    r = _json_schema(client, model, temperature=1.0, seed=3, n=2)
    for ch in r.choices:
        assert ch.finish_reason == "stop"
        jsonschema.validate(json.loads(ch.message.content), SCHEMA)


def test_named_tool_choice_gets_valid_arguments_streamed_or_not(demo):
    client, model = demo
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=model, messages=HI, tools=TOOLS, tool_choice=choice, max_tokens=MAX, temperature=0
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    chunks = list(
        client.chat.completions.create(
            model=model, messages=HI, tools=TOOLS, tool_choice=choice, max_tokens=MAX, temperature=0, stream=True
        )
    )
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments  # greedy: the same


def test_required_tool_choice_and_none(demo):
    client, model = demo
    r = client.chat.completions.create(
        model=model, messages=HI, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=MAX
    )
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name in ("get_weather", "get_time")
    if call.function.name == "get_weather":
        jsonschema.validate(args, WEATHER)
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=HI,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=MAX,
            stream=True,
        )
    )
    (streamed,) = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]  # one delta, at the end
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and streamed.function.name in ("get_weather", "get_time")
    json.loads(streamed.function.arguments)
    r = client.chat.completions.create(model=model, messages=HI, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert not r.choices[0].message.tool_calls


def test_regex_choice_and_grammar(demo):
    client, model = demo

    def text(extra):
        return client.completions.create(model=model, prompt="The code is", max_tokens=64, extra_body=extra)

    r = text({"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}})
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    assert text({"guided_regex": "(yes|no)!"}).choices[0].text in ("yes!", "no!")
    assert text({"guided_choice": ["alpha beta", "gamma"]}).choices[0].text in ("alpha beta", "gamma")
    assert text({"structured_outputs": {"choice": ["up", "down"]}}).choices[0].text in ("up", "down")
    assert text({"structured_outputs": {"grammar": 'root ::= "a" ("b" | "c")'}}).choices[0].text in ("ab", "ac")
    r = text({"guided_json": json.dumps(WEATHER), "max_tokens": MAX})
    jsonschema.validate(json.loads(r.choices[0].text), WEATHER)


def test_unconstrained_requests_batched_with_constrained_ones_keep_their_tokens(demo):
    client, model = demo

    def plain():
        r = client.completions.create(model=model, prompt="Attention lets", max_tokens=24, temperature=0)
        return r.choices[0].text

    alone = plain()
    with ThreadPoolExecutor(6) as pool:
        constrained = [pool.submit(_json_schema, client, model, temperature=0) for _ in range(3)]
        batched = [pool.submit(plain) for _ in range(3)]
        assert [f.result() for f in batched] == [alone] * 3
        for f in constrained:
            jsonschema.validate(json.loads(f.result().choices[0].message.content), SCHEMA)


@pytest.mark.parametrize(
    "kw, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "response_format",
        ),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
        ({"tools": TOOLS}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "structural_tag": "{}"}}}, "structural_tag"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
        ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex"),
    ],
)
def test_invalid_or_unsupported_is_a_400_naming_the_field(demo, kw, param):
    client, model = demo
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=HI, max_tokens=4, **kw)
    assert param in str(e.value)
    if kw.get("tool_choice", "auto") == "auto" and "tools" in kw:
        assert "tool parser" in str(e.value)


def test_json_schema_from_a_tiny_deepseek_v3_validates(tmp_path_factory):
    from hf_deepseek import make_deepseek_checkpoint

    from afd.model.demo import write_tokenizer

    path = str(tmp_path_factory.mktemp("ds") / "ckpt")
    make_deepseek_checkpoint(path, seed=10, vocab_size=512, eos_token_id=2, max_position_embeddings=1024)
    write_tokenizer(path, 512)
    assert os.path.isfile(os.path.join(path, "tokenizer.json"))
    c = _serve(tmp_path_factory.mktemp("ds-so"), path)
    try:
        client = openai.OpenAI(base_url=c.url() + "/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        r = _json_schema(client, model, temperature=0)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    finally:
        c.stop()
