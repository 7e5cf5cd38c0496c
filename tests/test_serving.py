"""End to end: a launched 1A1F cluster on a tiny HF checkpoint, over HTTP, against HF transformers."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster_helpers import Cluster, cluster_yaml, get, health, post
from hf_reference import PROMPTS, hf_greedy

pytestmark = pytest.mark.multiprocess
NEW = 16


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, tmp_path_factory):
    path = cluster_yaml(
        tmp_path_factory.mktemp("serving"), tiny_checkpoint, name="serving", engine={"kv_cache_bytes": "48KiB"}
    )  # 256 tokens: 16 requests at once must preempt
    with Cluster(path) as c:
        c.start_all()
        c.wait_ready()
        yield c


@pytest.fixture(scope="module")
def reference(families):
    return families.ref_ids("longcat_flash", "zero_experts", NEW)  # tiny_checkpoint's


def _complete(url: str, prompt, **kw) -> tuple[int, dict]:
    return post(
        url, "/v1/completions", {"prompt": prompt, "max_tokens": NEW, "temperature": 0, "return_token_ids": True, **kw}
    )


def test_concurrent_greedy_completions_equal_hf(cluster, reference):
    prompts = PROMPTS * 4  # 16 requests at once, more than the KV cache holds when they overlap
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: _complete(cluster.url(), p), prompts))
    for (code, body), p in zip(results, prompts):
        assert code == 200, body
        choice = body["choices"][0]
        assert choice["token_ids"] == reference[PROMPTS.index(p)]
        assert choice["prompt_token_ids"] == p
        assert body["usage"] == {
            "prompt_tokens": len(p),
            "completion_tokens": len(choice["token_ids"]),
            "total_tokens": len(p) + len(choice["token_ids"]),
        }
        assert choice["finish_reason"] == ("length" if len(choice["token_ids"]) == NEW else "stop")


def _preemptions(cluster) -> float:
    _, metrics = get(cluster.url(), "/metrics")
    preempted = [ln for ln in metrics.decode().splitlines() if ln.startswith("afd_num_preemptions_total")]
    assert preempted
    return float(preempted[0].split()[-1])


def test_prompts_beyond_the_kv_cache_are_preempted_and_keep_hfs_tokens(cluster, reference):
    """16 prompts in one request reach the scheduler in one step (concurrent requests may not overlap on a
    busy machine): their 16 x (prompt + NEW) tokens exceed the cache's 256, so some are preempted, and each
    is recomputed to HF's tokens."""
    before = _preemptions(cluster)
    prompts = PROMPTS * 4
    code, body = _complete(cluster.url(), prompts)
    assert code == 200, body
    for choice in body["choices"]:
        assert choice["token_ids"] == reference[PROMPTS.index(prompts[choice["index"]])]
    assert _preemptions(cluster) > before


def test_logprobs_are_hfs_and_penalties_apply(cluster, tiny_checkpoint):
    """logprobs are the model's (HF's log_softmax at the chosen token, top alternatives in order);
    a frequency penalty changes greedy output once tokens repeat."""
    import torch

    ((ids, logits),) = hf_greedy(tiny_checkpoint, PROMPTS[:1], NEW)
    code, body = _complete(cluster.url(), PROMPTS[0], logprobs=3)
    assert code == 200, body
    lp = body["choices"][0]["logprobs"]
    assert body["choices"][0]["token_ids"] == ids and len(lp["token_logprobs"]) == NEW
    for step, (got, top) in enumerate(zip(lp["token_logprobs"], lp["top_logprobs"])):
        ref = torch.log_softmax(logits[step], dim=-1)
        assert abs(got - ref[ids[step]].item()) < 1e-3
        assert len(top) <= 3 and abs(max(top.values()) - got) < 1e-6  # greedy: the best is the chosen one
    code, pen = _complete(cluster.url(), PROMPTS[0], frequency_penalty=2.0, presence_penalty=2.0)
    assert code == 200 and pen["choices"][0]["token_ids"] != ids


def _stream(url: str, body: dict, path: str = "/v1/completions") -> list[str]:
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        return [ln[len("data: ") :] for ln in r.read().decode().split("\n\n") if ln.startswith("data: ")]


def test_streaming_gives_the_same_tokens(cluster, reference):
    events = _stream(
        cluster.url(),
        {
            "prompt": PROMPTS[3],
            "max_tokens": NEW,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) > 3
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(reference[3])
    tokens = [t for c in chunks[:-1] for t in c["choices"][0]["token_ids"]]
    assert tokens == reference[3]
    assert all(c["object"] == "text_completion" for c in chunks)


BAD = [
    ({"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens", "max_tokens must be at least 1, got 0."),
    (
        {"prompt": [1, 2], "max_tokens": 1000},
        400,
        "max_tokens",
        "'max_tokens' or 'max_completion_tokens' is too large: 1000. This model's maximum context length is {L} "
        "tokens and your request has 2 input tokens (1000 > {L} - 2).",
    ),
    (
        {"prompt": list(range(1, 90)) * 6, "max_tokens": 1},
        400,
        "input_tokens",
        "This model's maximum context length is {L} tokens. However, your request has 534 input tokens. "
        "Please reduce the length of the input messages.",
    ),
    ({"prompt": [1, 500]}, 400, "prompt", "Token id 500 is out of vocabulary"),
    ({"max_tokens": 3}, 400, "body.prompt", "Field required"),
    ({"prompt": {"a": 1}}, 400, "body.prompt", "Input should be"),
    ({"prompt": [1, 2], "n": 0}, 400, "n", "n must be at least 1"),
    ({"prompt": [1, 2], "temperature": -1}, 400, "temperature", "temperature must be >= 0"),
    ({"prompt": "text"}, 400, "prompt", "no tokenizer.json"),
    ({"prompt": [1, 2], "model": "nope"}, 404, "model", "The model `nope` does not exist."),
]


@pytest.mark.parametrize("body,code,param,message", BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_bad_input_gets_a_4xx_and_the_server_keeps_serving(cluster, reference, body, code, param, message):
    status, err = post(cluster.url(), "/v1/completions", body)
    assert status == code
    assert err["error"]["code"] == code and err["error"]["param"] == param
    assert message.replace("{L}", str(_max_model_len(cluster))) in err["error"]["message"]
    assert err["error"]["type"] in ("BadRequestError", "Bad Request", "NotFoundError")
    status, ok = _complete(cluster.url(), PROMPTS[1])
    assert status == 200 and ok["choices"][0]["token_ids"] == reference[1]


def _max_model_len(cluster) -> int:
    return json.loads(get(cluster.url(), "/v1/models")[1])["data"][0]["max_model_len"]


def test_malformed_json_and_chat_without_tokenizer(cluster):
    status, err = post(cluster.url(), "/v1/completions", b"{not json")
    assert status == 400 and err["error"]["type"] == "Bad Request"
    status, err = post(cluster.url(), "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "tokenizer" in err["error"]["message"]


def test_models_version_health(cluster, tiny_checkpoint):
    code, body = get(cluster.url(), "/v1/models")
    data = json.loads(body)["data"][0]
    assert code == 200 and data["id"] == tiny_checkpoint
    assert data["max_model_len"] == 256  # the KV cache (48 KiB) holds fewer tokens than the model's 512
    code, body = get(cluster.url(), "/version")
    assert code == 200 and json.loads(body)["version"]
    assert health(cluster.url()) == 200


def test_afd_bench_against_the_cluster(cluster, tmp_path):
    from afd.entrypoints.cli import main

    rc = main(
        [
            "bench",
            "--base-url",
            cluster.url(),
            "--num-prompts",
            "200",
            "--random-input-len",
            "12",
            "--random-output-len",
            "6",
            "--max-concurrency",
            "32",
            "--vocab-size",
            "97",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "bench.json",
            "--disable-tqdm",
        ]
    )
    assert rc == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["completed"] == 200 and result["failed"] == 0
    assert result["total_output_tokens"] == 200 * 6
    for key in ("request_throughput", "output_throughput", "mean_ttft_ms", "p99_tpot_ms", "median_itl_ms"):
        assert result[key] > 0


def test_a_dead_engine_fails_its_requests_then_its_node_exits_for_a_restart(tiny_checkpoint, tmp_path):
    """Without rejoin (cluster.rejoin_timeout: 0) a dead peer fails every request at once, with a 503 naming why;
    then the attention node exits with code 3 rather than answer 503 for good behind a live process, so that its
    supervisor starts it again, and the cluster serves once both are back."""
    from attention_node.serving_node import ENGINE_STOPPED_EXIT

    path = cluster_yaml(tmp_path, tiny_checkpoint, name="dead", cluster={"rejoin_timeout": 0})
    with Cluster(path) as c:
        c.start_all()
        c.wait_ready()
        assert _complete(c.url(), PROMPTS[0])[0] == 200
        t0 = time.monotonic()
        c.kill("ffn0")
        assert c.procs["attn0"].wait(30) == ENGINE_STOPPED_EXIT
        log = c.log("attn0")
        assert "engine stopped" in log and f"exiting with code {ENGINE_STOPPED_EXIT}" in log, log[-2000:]
        assert time.monotonic() - t0 < 20
        c.start("ffn0")  # what the launcher does: each node's own command again
        c.start("attn0")
        c.wait_ready()
        code, body = _complete(c.url(), PROMPTS[0])
        assert code == 200, body


def _slow_model(tmp_path) -> str:
    """Dummy weights big enough that a few hundred tokens take seconds."""
    from afd.bench.step import BENCH_CONFIG

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(BENCH_CONFIG))
    return str(model)


@pytest.fixture(scope="module")
def slow_cluster(tmp_path_factory):
    """A 1A1F cluster of _slow_model's: the client-leaves case below runs on it, then the drain case, which
    ends it (file order, which pytest keeps and `make test`'s loadscope keeps on one worker): one start of
    node processes for the two, each of which leaves it as it found it or stops it."""
    tmp = tmp_path_factory.mktemp("slow")
    path = cluster_yaml(
        tmp,
        _slow_model(tmp),
        name="slow",
        model={"dummy_weights": True},
        engine={"shutdown_timeout": 60, "kv_cache_bytes": "64MiB"},
    )
    with Cluster(path) as c:
        c.start_all()
        c.wait_ready()
        yield c


def test_an_error_after_the_stream_started_is_an_event_then_done(tmp_path):
    path = cluster_yaml(
        tmp_path,
        _slow_model(tmp_path),
        name="midstream",
        model={"dummy_weights": True},
        engine={"kv_cache_bytes": "64MiB"},
        cluster={"rejoin_timeout": 2, "heartbeat_timeout": 2},
    )
    with Cluster(path) as c:
        c.start_all()
        c.wait_ready()
        req = urllib.request.Request(
            c.url() + "/v1/completions",
            method="POST",
            headers={"Content-Type": "application/json"},
            data=json.dumps({"prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": True, "stream": True}).encode(),
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
            first = r.readline()
            assert first.startswith(b"data: {")
            c.kill("ffn0")
            rest = r.read().decode()
    events = [e.strip()[len("data: ") :] for e in rest.split("\n\n") if e.strip().startswith("data: ")]
    assert events[-1] == "[DONE]", rest[-500:]
    err = json.loads(events[-2])["error"]
    assert err["code"] == 503 and "peer process is probably gone" in err["message"]
    assert "no pair formed with FFN node ffn0 within 2s" in err["message"]  # the stream waited for one, then gave up


def test_a_non_streaming_request_stops_when_its_client_leaves(slow_cluster):
    """vLLM aborts a request whose client disconnected; so does afd, streaming or not."""
    import socket

    c = slow_cluster
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 3000, "ignore_eos": True}).encode()
    host, port = c.url().removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        end = time.monotonic() + 30
        while _running(c.url()) < 1:
            assert time.monotonic() < end, "the request never started"
            time.sleep(0.05)
    end = time.monotonic() + 5  # the client is gone: the engine must drop the request, not finish it
    while _running(c.url()) > 0:
        assert time.monotonic() < end, "the request kept running after its client left"
        time.sleep(0.05)
    _, metrics = get(c.url(), "/metrics")
    aborted = [ln for ln in metrics.decode().splitlines() if ln.startswith("afd_generation_tokens_total")]
    assert aborted and float(aborted[0].split()[-1]) < 3000


def test_sigterm_drains_running_requests_and_refuses_new_ones(slow_cluster):
    TOKENS = 150  # about 2 s here: the drain is seen while it runs (checked), with time to spare
    c = slow_cluster
    result = {}
    long = threading.Thread(
        target=lambda: result.update(
            r=post(
                c.url(),
                "/v1/completions",
                {"prompt": [1, 2, 3], "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0},
            )
        )
    )
    long.start()
    end = time.monotonic() + 30
    while _running(c.url()) < 1:
        assert time.monotonic() < end, "the request never started"
        time.sleep(0.02)
    c.procs["attn0"].send_signal(signal.SIGTERM)
    while health(c.url()) != 503:
        assert time.monotonic() < end + 10, "SIGTERM did not start a drain"
        time.sleep(0.02)
    status, err = _complete(c.url(), PROMPTS[0])
    assert status == 503 and "draining" in err["error"]["message"]
    assert long.is_alive(), "the running request ended before the drain was seen: nothing was drained"
    long.join(60)
    status, body = result["r"]
    assert status == 200 and body["usage"]["completion_tokens"] == TOKENS
    assert c.procs["attn0"].wait(15) == 0
    assert c.procs["ffn0"].wait(15) == 0  # every attention node left: the FFN node stops too


def _running(url: str) -> float:
    _, metrics = get(url, "/metrics")
    lines = [ln for ln in metrics.decode().splitlines() if ln.startswith("afd_num_requests_running{")]
    return float(lines[0].split()[-1]) if lines else 0.0
