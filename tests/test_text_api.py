"""Text in and out through the API on the demo checkpoint (it ships a tokenizer and a chat template):
chat, stop strings, streaming text equal to the full response, seeded sampling, n, API key."""

from __future__ import annotations

import contextlib
import json
import urllib.request

import pytest
from cluster_helpers import Cluster, cluster_yaml, post

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    path = cluster_yaml(tmp_path_factory.mktemp("text"), "demo", name="text")
    with Cluster(path, env={"AFD_API_KEY": "k3y"}) as c:
        c.start_all()
        c.wait_ready()
        yield c


AUTH = {"Authorization": "Bearer k3y"}


def _sse(url: str, path: str, body: dict) -> list[dict]:
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json", **AUTH}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [e[len("data: ") :] for e in r.read().decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_api_key_is_required(demo):
    code, err = post(demo.url(), "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert code == 401 and err["error"]["code"] == 401
    code, _ = post(demo.url(), "/v1/completions", {"prompt": "hi", "max_tokens": 2}, AUTH)
    assert code == 200


def test_streamed_text_equals_the_full_response(demo):
    body = {"prompt": "Attention nodes keep the cache", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    code, full = post(demo.url(), "/v1/completions", body, AUTH)
    assert code == 200
    chunks = _sse(demo.url(), "/v1/completions", {**body, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]


def test_stop_string_truncates_and_is_reported(demo):
    body = {"prompt": "Experts", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    text = post(demo.url(), "/v1/completions", body, AUTH)[1]["choices"][0]["text"]
    stop = text[5:8]
    assert len(stop) == 3
    code, r = post(demo.url(), "/v1/completions", {**body, "stop": [stop]}, AUTH)
    choice = r["choices"][0]
    assert code == 200 and choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == text[: text.index(stop)]
    streamed = _sse(demo.url(), "/v1/completions", {**body, "stop": [stop], "stream": True})
    assert "".join(c["choices"][0]["text"] for c in streamed) == choice["text"]


def test_chat_completion_and_stream(demo):
    body = {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        "max_completion_tokens": 8,
        "temperature": 0,
    }
    code, r = post(demo.url(), "/v1/chat/completions", body, AUTH)
    assert code == 200 and r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
    msg = r["choices"][0]["message"]
    assert msg["role"] == "assistant" and r["usage"]["completion_tokens"] <= 8
    chunks = _sse(demo.url(), "/v1/chat/completions", {**body, "stream": True})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == msg["content"]


def test_seeded_sampling_reproduces_and_n_gives_choices(demo):
    body = {
        "prompt": "The FFN node",
        "max_tokens": 12,
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": 50,
        "seed": 7,
        "n": 3,
        "return_token_ids": True,
    }
    a = post(demo.url(), "/v1/completions", body, AUTH)[1]
    b = post(demo.url(), "/v1/completions", body, AUTH)[1]
    assert [c["token_ids"] for c in a["choices"]] == [c["token_ids"] for c in b["choices"]]
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert len({tuple(c["token_ids"]) for c in a["choices"]}) > 1  # seed + i per choice


def test_echo_prepends_the_prompt(demo):
    body = {"prompt": "Experts route tokens", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    plain = post(demo.url(), "/v1/completions", body, AUTH)[1]["choices"][0]["text"]
    echoed = post(demo.url(), "/v1/completions", {**body, "echo": True}, AUTH)[1]["choices"][0]["text"]
    assert echoed == "Experts route tokens" + plain
    chunks = _sse(demo.url(), "/v1/completions", {**body, "echo": True, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == echoed


def _json(conn, path: str, raw: str | bytes, headers: dict | None = None) -> tuple[int, dict]:
    conn.request("POST", path, body=raw, headers={"Content-Type": "application/json", **AUTH, **(headers or {})})
    r = conn.getresponse()
    return r.status, json.loads(r.read() or b"{}")


HOSTILE = [  # (path, raw JSON body, expected status, expected param)
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "seed": 18446744073709551616}', 400, "body.seed"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "temperature": NaN}', 400, "body.temperature"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "top_p": Infinity}', 400, "body.top_p"),
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "prompt"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "presence_penalty": 2.5}', 400, "presence_penalty"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "logit_bias": {"x": 10}}', 400, "logit_bias"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "logit_bias": {"99999": 1}}', 400, "logit_bias"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "prompt_logprobs": 1}', 400, "prompt_logprobs"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "logprobs": 2, "echo": true}', 400, "logprobs"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}',
        400,
        "top_logprobs",
    ),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "best_of": 3}', 400, "best_of"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "suffix": "!"}', 400, "suffix"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "n": 20000}', 400, "n"),
    ("/v1/chat/completions", '{"messages": [{"role": "", "content": "x"}], "max_tokens": 2}', 400, "messages.role"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}], "max_tokens": 2}',
        400,
        "messages",
    ),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
        400,
        "messages",
    ),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": [{"type": "image_url"}]}], "max_tokens": 2}',
        400,
        "messages.content",
    ),
]


def test_hostile_requests_get_4xx_on_a_connection_that_keeps_serving(demo):
    """Each request a fuzzer found a 500 with (or that killed the engine) is refused alone: the same
    keep-alive connection then gets the right answer."""
    import http.client

    good = json.dumps({"prompt": "Experts are", "max_tokens": 6, "temperature": 0, "return_token_ids": True})
    host, port = demo.url().removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    code, ref = _json(conn, "/v1/completions", good)
    assert code == 200
    for path, raw, status, param in HOSTILE:
        code, err = _json(conn, path, raw)
        assert (code, err["error"]["param"]) == (status, param), (raw, err)
        code, again = _json(conn, "/v1/completions", good)
        assert code == 200 and again["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"], raw
    conn.close()


def test_lists_past_what_the_model_can_use_are_400s_small_or_large(demo):
    """`logit_bias` or `stop_token_ids` longer than the vocabulary, more stop strings than the server
    takes, more messages than a context holds: a 400 naming the field, from the node's own parse for a small
    body and from the child before the node parses a large one (over 1 MiB: attention_node/body_check.py)."""
    url = demo.url()
    context = post(url, "/tokenize", {"prompt": "hi"}, AUTH)[1]["max_model_len"]
    many = 200_000  # past the demo's vocabulary and context, and over 1 MiB as JSON
    for path, body, param in (
        ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(many)}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1] * many}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "hi", "stop": ["xy"] * 2000}, "stop"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * many}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * (context + 1)}, "messages"),
    ):
        code, err = post(url, path, {**body, "max_tokens": 1}, AUTH)
        assert (code, err["error"]["param"]) == (400, param), (path, param, str(err)[:300])


def test_a_list_past_its_bound_is_refused_before_the_body_ends(demo):
    """The child reads a large body while it arrives, so the 400 for a list past its bound comes once
    that part is in: here after 2 MiB of a body that says it has 8. The rest may still be sent (a client that
    writes its whole body before reading, as urllib does, then reads the 400); the connection closes after it."""
    import http.client

    body = json.dumps({"stop_token_ids": [1] * (3 << 20), "prompt": "hi"}).encode()[: 8 << 20]
    host, port = demo.url().removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/completions")
    for k, v in {"Content-Type": "application/json", "Content-Length": str(len(body)), **AUTH}.items():
        conn.putheader(k, v)
    conn.endheaders(body[: 2 << 20])
    r = conn.getresponse()
    assert r.status == 400 and json.loads(r.read())["error"]["param"] == "stop_token_ids"
    assert r.getheader("connection") == "close"
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        conn.send(body[2 << 20 :])  # taken and dropped
    conn.close()
    assert post(demo.url(), "/v1/completions", {"prompt": "hi", "max_tokens": 1}, AUTH)[0] == 200


def test_developer_role_and_content_parts_render_like_plain_messages(demo):
    def prompt_tokens(messages) -> int:
        code, r = post(demo.url(), "/v1/chat/completions", {"messages": messages, "max_tokens": 1}, AUTH)
        assert code == 200, r
        return r["usage"]["prompt_tokens"]

    plain = prompt_tokens([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert (
        prompt_tokens(
            [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ]
        )
        == plain
    )


def test_oversized_body_is_refused_before_it_is_read(demo):
    import http.client

    host, port = demo.url().removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/completions")
    for k, v in {"Content-Type": "application/json", "Content-Length": str(1 << 30), **AUTH}.items():
        conn.putheader(k, v)
    conn.endheaders()
    r = conn.getresponse()
    assert r.status == 413 and json.loads(r.read())["error"]["param"] == "body"
    conn.close()


def test_oversized_chunked_body_is_refused_once_the_limit_is_passed(demo):
    """No Content-Length to judge by: the guard counts the chunks as they arrive."""
    import http.client

    host, port = demo.url().removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    chunks = (b'{"prompt": "' + b"a" * (1 << 20),) + (b"a" * (1 << 20),) * 40 + (b'"}',)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the answer may come before the upload ends
        conn.request(
            "POST",
            "/v1/completions",
            body=iter(chunks),
            encode_chunked=True,
            headers={"Content-Type": "application/json", **AUTH},
        )
    r = conn.getresponse()
    body = json.loads(r.read())
    assert r.status == 413 and body["error"]["param"] == "body" and "larger than" in body["error"]["message"]
    conn.close()


def test_openapi_documents_the_status_codes_served(demo):
    with urllib.request.urlopen(demo.url() + "/openapi.json", timeout=10) as r:
        spec = json.load(r)
    codes = spec["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in codes and {"200", "400", "500", "503"} <= set(codes)


def test_chat_logprobs_have_openais_shape(demo):
    code, r = post(
        demo.url(),
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
        AUTH,
    )
    assert code == 200, r
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    text = "".join(c["token"] for c in content)
    assert text == r["choices"][0]["message"]["content"] or r["choices"][0]["finish_reason"] == "stop"
    for c in content:
        assert set(c) == {"token", "logprob", "bytes", "top_logprobs"} and len(c["top_logprobs"]) == 2
        assert c["logprob"] == max(t["logprob"] for t in c["top_logprobs"]) <= 0
