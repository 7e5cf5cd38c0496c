"""`afd bench`: load generator for any OpenAI-compatible completions server, like `vllm bench serve`.

Flags, metric definitions and result-JSON keys follow `vllm bench serve` (CONVENTIONS.md, "Benchmark
client"), so the same dashboards and comparison scripts read the results of both.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from datetime import datetime

from afd.bench.common import at_least, count_flag
from afd.config.flags import DefaultsHelpFormatter

# aiohttp, numpy and tqdm are imported where used: `afd --help` and the other subcommands should not pay for them.

DEFAULT_METRICS = "ttft,tpot,itl,e2el"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="load-test an OpenAI-compatible completions server (like `vllm bench serve`)",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="model name to send (default: the first id of GET /v1/models)")
    p.add_argument("--dataset-name", default="random", help="only `random` is supported")
    count_flag(p, "--random-input-len", 1024)
    count_flag(p, "--random-output-len", 128)
    p.add_argument(
        "--shared-prefix-len",
        "--random-prefix-len",
        dest="shared_prefix_len",
        type=at_least(0),
        default=0,
        help="every prompt starts with the same N random tokens, then its own --random-input-len ones "
        "(vLLM's --random-prefix-len; a prefix-caching workload; at least 0)",
    )
    p.add_argument(
        "--random-range-ratio", type=float, default=0.0, help="lengths are drawn uniformly from [len*(1-r), len*(1+r)]"
    )
    count_flag(p, "--num-prompts", 1000)
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second with Poisson arrivals; inf (default) sends all at once",
    )
    p.add_argument(
        "--max-concurrency", type=at_least(1), default=None, help="most requests in flight at once (at least 1)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentile-metrics", default=DEFAULT_METRICS)
    p.add_argument("--metric-percentiles", default="50,90,99")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--api-key", default=None, help="bearer token (default: $AFD_API_KEY, else $OPENAI_API_KEY)")
    p.add_argument(
        "--vocab-size",
        type=at_least(1),
        default=None,
        help="prompt token ids are drawn from [0, vocab-size) (default: the --tokenizer's vocabulary, "
        "else the vocab_size the server lists in GET /v1/models; at least 1)",
    )
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (servers that reject the field, e.g. transformers serve); "
        "outputs may then end early at EOS",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="checkpoint dir with tokenizer.json: send prompts as text decoded from the random ids "
        "(for servers that take only text, e.g. transformers serve)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=run)


def _validated(args) -> tuple[list[str], list[float]]:
    from afd.bench.metrics import METRIC_TITLES

    if args.dataset_name != "random":
        raise ValueError(f"--dataset-name {args.dataset_name!r} is not supported; only 'random' is")
    for flag in ("num_prompts", "random_input_len", "random_output_len", "vocab_size"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if getattr(args, "shared_prefix_len", 0) < 0:
        raise ValueError(f"--shared-prefix-len must be at least 0, got {args.shared_prefix_len}")
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in metrics if m not in METRIC_TITLES]
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {', '.join(unknown)}; choose from {DEFAULT_METRICS}")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError:
        raise ValueError(
            f"--metric-percentiles: expected numbers like 50,90,99, got {args.metric_percentiles!r}"
        ) from None
    if any(not 0 <= p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles must lie in [0, 100], got {args.metric_percentiles!r}")
    return metrics, percentiles


def _lengths(rng, mean: int, ratio: float, n: int) -> list[int]:
    lo = max(1, int(mean * (1 - ratio)))
    hi = max(lo, int(mean * (1 + ratio)))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def sample_requests(args) -> list[tuple[list[int] | str, int]]:
    """(prompt token ids, max_tokens) per request; token ids need no tokenizer on either side.
    With --tokenizer, each prompt is those ids decoded to text."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    in_lens = _lengths(rng, args.random_input_len, args.random_range_ratio, args.num_prompts)
    out_lens = _lengths(rng, args.random_output_len, args.random_range_ratio, args.num_prompts)
    reqs = [(rng.integers(0, args.vocab_size, size=n).tolist(), o) for n, o in zip(in_lens, out_lens)]
    shared = getattr(args, "shared_prefix_len", 0)
    if shared:  # a generator of its own, so that each prompt's own tokens do not change with the prefix
        prefix = np.random.default_rng([args.seed, 2]).integers(0, args.vocab_size, size=shared).tolist()
        reqs = [(prefix + ids, o) for ids, o in reqs]
    if not getattr(args, "tokenizer", None):
        return reqs
    from afd.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    if tok is None:
        raise ValueError(f"--tokenizer {args.tokenizer}: no tokenizer.json there")
    return [(tok.decode(ids, skip_special_tokens=True), o) for ids, o in reqs]


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds after the start: all 0 for an infinite rate, else a seeded Poisson process."""
    if math.isinf(rate):
        return [0.0] * n
    import numpy as np

    # A generator of its own, so that the prompts do not change with the rate.
    gaps = np.random.default_rng([seed, 1]).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def _error_text(err) -> str:
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)


async def send_request(session, url: str, payload: dict, t0: float):
    """Stream one completion; never raises: failures come back as a result with `error` set."""
    from afd.bench.metrics import RequestResult

    prompt = payload["prompt"]
    # a text prompt's token count is a word-count guess until the server's usage says otherwise
    r = RequestResult(prompt_len=len(prompt) if isinstance(prompt, list) else len(prompt.split()))
    start = time.perf_counter()
    r.start = start - t0
    chunks, last, usage_tokens = 0, start, None
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return r
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments, keep-alives
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if "error" in event:
                    r.error = _error_text(event["error"])
                    return r
                if event.get("choices"):
                    if chunks == 0:
                        r.ttft = now - start
                    else:
                        r.itl.append(now - last)
                    last, chunks = now, chunks + 1
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                    # the server's count: exact for text prompts too, where the client only guessed
                    r.prompt_len = event["usage"].get("prompt_tokens") or r.prompt_len
            r.latency = time.perf_counter() - start
    except Exception as e:  # timeouts, dropped connections, bad JSON: all count as a failed request
        r.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return r
    if chunks == 0:
        r.error = "stream ended without a completion chunk"
        return r
    r.output_tokens = usage_tokens or chunks
    r.success = True
    return r


def vocab_size(args, api_key: str | None) -> int:
    """Where prompt ids come from when --vocab-size is not given: the tokenizer's vocabulary, else the
    one the server lists (afd's /v1/models carries vocab_size); ids past it would be refused."""
    if args.tokenizer:
        from afd.engine.tokenizer import load_tokenizer

        tok = load_tokenizer(args.tokenizer)
        if tok is None:
            raise ValueError(f"--tokenizer {args.tokenizer}: no tokenizer.json there")
        return tok.vocab_size
    import json
    import urllib.request

    url = f"{args.base_url.rstrip('/')}/v1/models"
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            models = json.load(r).get("data") or []
    except (OSError, ValueError) as e:
        raise ValueError(f"GET {url} failed ({e}); check --base-url, or pass --vocab-size") from None
    sizes = [m["vocab_size"] for m in models if isinstance(m.get("vocab_size"), int)]
    if not sizes:
        raise ValueError(f"GET {url} lists no vocab_size; pass --vocab-size or --tokenizer")
    return sizes[0]


async def first_model(session, base_url: str) -> str:
    url = f"{base_url}/v1/models"
    try:
        async with session.get(url) as resp:
            body = await resp.json(content_type=None) if resp.status == 200 else None
    except Exception as e:
        raise ValueError(f"GET {url} failed ({type(e).__name__}: {e}); check --base-url or pass --model") from None
    models = (body or {}).get("data") or []
    if not models:
        raise ValueError(f"GET {url} listed no model; pass --model")
    return models[0]["id"]


async def _bench(args, requests, api_key: str | None):
    import aiohttp
    from tqdm import tqdm

    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    # The semaphore, not the connection pool, is what bounds concurrency.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        model = args.model or await first_model(session, base)
        print(
            f"afd bench: {len(requests)} prompts -> {base}{args.endpoint} model={model} "
            f"rate={args.request_rate} max_concurrency={args.max_concurrency}"
        )
        bar = tqdm(total=len(requests), disable=args.disable_tqdm)

        async def one(prompt: list[int], max_tokens: int):
            payload = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if args.no_ignore_eos:
                del payload["ignore_eos"]
            if sem is None:
                r = await send_request(session, base + args.endpoint, payload, t0)
            else:
                async with sem:
                    r = await send_request(session, base + args.endpoint, payload, t0)
            bar.update(1)
            return r

        t0 = time.perf_counter()
        tasks = []
        for (prompt, max_tokens), at in zip(requests, arrival_offsets(len(requests), args.request_rate, args.seed)):
            # Sleep to an absolute send time so that scheduling delays do not accumulate.
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(prompt, max_tokens)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    return list(results), duration, model


def result_filename(rate: float, max_concurrency: int | None, model: str, now: datetime) -> str:
    conc = f"-concurrency{max_concurrency}" if max_concurrency else ""
    rate_s = "inf" if math.isinf(rate) else f"{rate:g}"
    base = model.rstrip("/").split("/")[-1]
    return f"afd-{rate_s}qps{conc}-{base}-{now.strftime('%Y%m%d-%H%M%S')}.json"


def build_result(args, model: str, results, summary: dict, now: datetime) -> dict:
    return {
        "date": now.strftime("%Y%m%d-%H%M%S"),
        "backend": "afd",
        "model_id": model,
        "num_prompts": args.num_prompts,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency,
        **summary,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "errors": [r.error for r in results],
    }


def run(args) -> int:
    from afd.bench import metrics as bm

    metrics, percentiles = _validated(args)
    api_key = args.api_key or os.environ.get("AFD_API_KEY") or os.environ.get("OPENAI_API_KEY")
    if args.vocab_size is None:
        args.vocab_size = vocab_size(args, api_key)
    requests = sample_requests(args)
    results, duration, model = asyncio.run(_bench(args, requests, api_key))
    summary = bm.summarize(results, duration, metrics, percentiles)
    print(bm.format_report(summary, metrics, percentiles, args.max_concurrency))
    errors = bm.distinct_errors(results)
    if errors:
        print("First errors:")
        for text, count in errors:
            print(f"  [{count}x] {text}")
    if args.save_result:
        now = datetime.now()
        name = args.result_filename or result_filename(args.request_rate, args.max_concurrency, model, now)
        os.makedirs(args.result_dir, exist_ok=True)
        path = os.path.join(args.result_dir, name)
        with open(path, "w") as f:
            json.dump(build_result(args, model, results, summary, now), f, indent=2)
        print(f"result saved to {path}")
    return 0 if summary["completed"] else 1
