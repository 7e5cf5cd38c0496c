"""`afd bench`: metric math on known timings, and a run against a small streaming server in a thread."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading

import pytest
from aiohttp import web

from afd.bench import metrics as bm
from afd.bench import serve as bench_serve

API_KEY = "test-key"
FAIL_503_AT = 3  # the request numbers (in arrival order at the server) that fail, one per kind of failure
FAIL_EVENT_AT = 7
COUNT = web.AppKey("count", list)  # a one-element list: the app's state must not be reassigned once started


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


# --- metric math -------------------------------------------------------------------------------------


def _records() -> list[bm.RequestResult]:
    return [
        # 5 tokens, first after 100 ms, then every 50 ms: latency 300 ms, TPOT 50 ms.
        bm.RequestResult(
            prompt_len=10, success=True, output_tokens=5, start=0.0, ttft=0.1, latency=0.3, itl=[0.05, 0.05, 0.05, 0.05]
        ),
        # 3 tokens, first after 200 ms, then 100 ms apart: latency 400 ms, TPOT 100 ms.
        bm.RequestResult(
            prompt_len=20, success=True, output_tokens=3, start=1.5, ttft=0.2, latency=0.4, itl=[0.1, 0.1]
        ),
        # A one-token reply has no TPOT.
        bm.RequestResult(prompt_len=30, success=True, output_tokens=1, start=0.0, ttft=0.3, latency=0.3),
        bm.RequestResult(prompt_len=40, error="HTTP 503: busy"),
    ]


def test_tpot_and_metric_values():
    rs = _records()
    assert bm.tpot(rs[0]) == pytest.approx(0.05)
    assert bm.tpot(rs[1]) == pytest.approx(0.1)
    assert bm.tpot(rs[2]) is None
    assert bm.metric_values(rs, "ttft") == pytest.approx([0.1, 0.2, 0.3])
    assert bm.metric_values(rs, "tpot") == pytest.approx([0.05, 0.1])
    assert bm.metric_values(rs, "itl") == pytest.approx([0.05] * 4 + [0.1] * 2)
    assert bm.metric_values(rs, "e2el") == pytest.approx([0.3, 0.4, 0.3])


def test_percentile_keys_and_stats():
    assert bm.percentile_label(99) == "99"
    assert bm.percentile_label(99.0) == "99"
    assert bm.percentile_label(99.9) == "99.9"
    s = bm.metric_stats([0.1, 0.2, 0.3, 0.4], "ttft", [50, 99.9])
    assert s["mean_ttft_ms"] == pytest.approx(250.0)
    assert s["median_ttft_ms"] == pytest.approx(250.0)
    assert s["std_ttft_ms"] == pytest.approx(111.803, abs=1e-3)  # population std, like numpy's default
    assert s["p50_ttft_ms"] == pytest.approx(250.0)
    assert s["p99.9_ttft_ms"] == pytest.approx(399.7)  # linear interpolation between 300 and 400
    assert bm.metric_stats([], "itl", [99]) == {
        "mean_itl_ms": 0.0,
        "median_itl_ms": 0.0,
        "std_itl_ms": 0.0,
        "p99_itl_ms": 0.0,
    }


def test_summarize_totals_and_keys():
    s = bm.summarize(_records(), 2.0, ["ttft", "tpot", "itl", "e2el"], [50, 90, 99])
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["total_input_tokens"] == 60  # failed requests do not count
    assert s["total_output_tokens"] == 9
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx(34.5)
    # Second 0 holds request 0's 5 tokens and request 2's 1; request 1's 3 arrive in second 1.
    assert s["max_output_tokens_per_s"] == 6.0
    assert s["median_tpot_ms"] == pytest.approx(75.0)
    for m in ("ttft", "tpot", "itl", "e2el"):
        for k in ("mean", "median", "std", "p50", "p90", "p99"):
            assert f"{k}_{m}_ms" in s
    report = bm.format_report(s, ["ttft", "tpot", "itl", "e2el"], [50, 90, 99], 4)
    assert "Successful requests:" in report and "P99 ITL (ms):" in report and "Maximum request concurrency:" in report
    assert bm.distinct_errors(_records()) == [("HTTP 503: busy", 1)]


def test_sampling_is_seeded_and_in_range():
    args = _parse(
        [
            "--num-prompts",
            "50",
            "--random-input-len",
            "20",
            "--random-output-len",
            "10",
            "--random-range-ratio",
            "0.5",
            "--vocab-size",
            "100",
            "--seed",
            "3",
        ]
    )
    reqs = bench_serve.sample_requests(args)
    assert reqs == bench_serve.sample_requests(args)
    assert all(10 <= len(p) <= 30 and 5 <= o <= 15 for p, o in reqs)
    assert all(isinstance(t, int) and 0 <= t < 100 for p, _ in reqs for t in p)
    offsets = bench_serve.arrival_offsets(200, 10.0, 0)
    assert offsets == bench_serve.arrival_offsets(200, 10.0, 0) and offsets[0] == 0.0
    assert offsets == sorted(offsets) and 10 < offsets[-1] < 30  # 199 gaps of mean 0.1 s
    assert bench_serve.arrival_offsets(3, float("inf"), 0) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "argv",
    [
        ["--dataset-name", "sharegpt"],
        ["--random-range-ratio", "1.5"],
        ["--request-rate", "0"],
        ["--percentile-metrics", "ttft,foo"],
        ["--metric-percentiles", "50,x"],
    ],
)
def test_bad_flags_raise_value_error(argv):
    with pytest.raises(ValueError):
        bench_serve.run(_parse(argv))


@pytest.mark.parametrize("argv", [["--num-prompts", "0"], ["--max-concurrency", "0"]])
def test_counts_below_their_minimum_are_refused_as_parsed(argv):
    with pytest.raises(SystemExit):
        _parse(argv)


# --- end to end against a small streaming server -----------------------------------------------------


VOCAB = {"size": 512}
"""The vocab_size the fake server lists (afd's /v1/models does; None: a server that does not)."""


async def _models(request):
    model = {"id": "org/tiny-model", "object": "model"}
    if VOCAB["size"] is not None:
        model["vocab_size"] = VOCAB["size"]
    return web.json_response({"object": "list", "data": [model]})


async def _completions(request):
    app = request.app
    if request.headers.get("Authorization") != f"Bearer {API_KEY}":
        return web.json_response({"error": {"message": "bad key", "code": 401}}, status=401)
    body = await request.json()
    assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}
    assert all(isinstance(t, int) for t in body["prompt"])
    app[COUNT][0] += 1
    n = app[COUNT][0]
    if n == FAIL_503_AT:
        return web.json_response({"error": {"message": "queue full", "code": 503}}, status=503)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)

    async def send(obj) -> None:
        await resp.write(f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n".encode())

    for i in range(body["max_tokens"]):
        await asyncio.sleep(0.001)
        if n == FAIL_EVENT_AT and i == 1:
            await send({"error": {"message": "engine died", "type": "InternalServerError", "code": 500}})
            await send("[DONE]")
            return resp
        await send(
            {
                "object": "text_completion",
                "model": body["model"],
                "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}],
            }
        )
    usage = {
        "prompt_tokens": len(body["prompt"]),
        "completion_tokens": body["max_tokens"],
        "total_tokens": len(body["prompt"]) + body["max_tokens"],
    }
    await send({"object": "text_completion", "model": body["model"], "choices": [], "usage": usage})
    await send("[DONE]")
    return resp


@pytest.fixture
def server():
    """Base URL of a streaming completions server running on its own event loop in a thread."""
    loop = asyncio.new_event_loop()
    app = web.Application()
    app[COUNT] = [0]
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", _completions)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    loop.run_until_complete(web.SockSite(runner, sock).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.close()


def test_end_to_end(server, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AFD_API_KEY", API_KEY)
    args = _parse(
        [
            "--base-url",
            server,
            "--num-prompts",
            "20",
            "--random-input-len",
            "16",
            "--random-output-len",
            "8",
            "--random-range-ratio",
            "0.5",
            "--max-concurrency",
            "4",
            "--metric-percentiles",
            "50,99.9",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--disable-tqdm",
        ]
    )
    assert bench_serve.run(args) == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "queue full" in out and "engine died" in out

    [path] = tmp_path.glob("afd-infqps-concurrency4-tiny-model-*.json")
    res = json.loads(path.read_text())
    assert res["backend"] == "afd" and res["model_id"] == "org/tiny-model"
    assert res["num_prompts"] == 20 and res["request_rate"] == "inf" and res["max_concurrency"] == 4
    assert res["completed"] == 18 and res["failed"] == 2
    assert res["request_throughput"] > 0 and res["output_throughput"] > 0 and res["total_token_throughput"] > 0
    assert res["max_output_tokens_per_s"] > 0
    for m in ("ttft", "tpot", "itl", "e2el"):
        for k in ("mean", "median", "std", "p50", "p99.9"):
            assert f"{k}_{m}_ms" in res
    ok = [i for i, e in enumerate(res["errors"]) if not e]
    # Output tokens come from the usage chunk and equal max_tokens, which ignore_eos makes the server honour.
    assert res["total_output_tokens"] == sum(res["output_lens"][i] for i in ok)
    assert all(4 <= res["output_lens"][i] <= 12 for i in ok)
    assert res["total_input_tokens"] == sum(res["input_lens"][i] for i in ok)
    assert all(len(res["itls"][i]) == res["output_lens"][i] - 1 for i in ok)
    assert res["mean_ttft_ms"] > 0 and res["mean_tpot_ms"] > 0


def test_all_failed_exits_1(server, capsys):
    # Wrong key: every request gets a 401.
    args = _parse(
        [
            "--base-url",
            server,
            "--model",
            "m",
            "--num-prompts",
            "3",
            "--random-input-len",
            "4",
            "--random-output-len",
            "2",
            "--api-key",
            "wrong",
            "--disable-tqdm",
        ]
    )
    assert bench_serve.run(args) == 1
    assert "HTTP 401" in capsys.readouterr().out


def test_poisson_rate_runs(server, monkeypatch):
    monkeypatch.setenv("AFD_API_KEY", API_KEY)
    args = _parse(
        [
            "--base-url",
            server,
            "--num-prompts",
            "5",
            "--random-input-len",
            "4",
            "--random-output-len",
            "2",
            "--request-rate",
            "200",
            "--disable-tqdm",
        ]
    )
    assert bench_serve.run(args) == 0


def test_prompt_ids_come_from_the_servers_vocabulary(server, monkeypatch):
    """The README's line once drew ids from [0, 1000) against a 512-token demo: every request failed."""
    args = _parse(["--base-url", server, "--num-prompts", "50", "--random-input-len", "40"])
    assert bench_serve.vocab_size(args, None) == 512
    args.vocab_size = 512
    assert max(t for p, _ in bench_serve.sample_requests(args) for t in p) < 512
    monkeypatch.setitem(VOCAB, "size", None)
    with pytest.raises(ValueError, match="lists no vocab_size; pass --vocab-size or --tokenizer"):
        bench_serve.vocab_size(args, None)
