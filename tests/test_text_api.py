"""Text in and out through the API on the demo checkpoint (it ships a tokenizer and a chat template):
chat, stop strings, streaming text equal to the full response, seeded sampling, n, API key."""

from __future__ import annotations

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
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **AUTH})
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [e[len("data: "):] for e in r.read().decode().split("\n\n") if e.startswith("data: ")]
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
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
            "max_completion_tokens": 8, "temperature": 0}
    code, r = post(demo.url(), "/v1/chat/completions", body, AUTH)
    assert code == 200 and r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
    msg = r["choices"][0]["message"]
    assert msg["role"] == "assistant" and r["usage"]["completion_tokens"] <= 8
    chunks = _sse(demo.url(), "/v1/chat/completions", {**body, "stream": True})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == msg["content"]


def test_seeded_sampling_reproduces_and_n_gives_choices(demo):
    body = {"prompt": "The FFN node", "max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "top_k": 50,
            "seed": 7, "n": 3, "return_token_ids": True}
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
