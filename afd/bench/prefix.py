"""Prefix caching on against off on a shared-prefix workload, side by side (docs/benchmarks/prefix-caching.md).

Two `afd serve demo` clusters at 1A1F run at once, one with --enable-prefix-caching and one with
--no-enable-prefix-caching; each round sends both the same `afd bench` load (N requests that share a
P-token random prefix, then their own tokens, all sent at once), one server after the other in an order
that alternates by round, with a new seed each round so that no round reuses an earlier one's prompts.
Round 0 is a warm-up. The hit rate is read from the servers' afd_prefix_cache_{hits,queries}_total.

    python -m afd.bench.prefix --rounds 7 --output docs/bench/prefix.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from afd.bench import serve as bench_serve
from afd.bench.common import count_flag
from afd.cluster.host import free_ports
from afd.cluster.processes import Command, NodeProcesses

MODES = ("on", "off")
KEYS = ("median_ttft_ms", "mean_ttft_ms", "p99_ttft_ms", "request_throughput", "output_throughput", "duration")


def _command(port: int, mode: str, args) -> Command:
    flag = "--enable-prefix-caching" if mode == "on" else "--no-enable-prefix-caching"
    argv = (sys.executable, "-m", "afd", "serve", args.model, "--port", str(port), flag)
    return Command(f"serve-{mode}", (*argv, "--max-num-batched-tokens", str(args.max_num_batched_tokens)))


def _status(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except OSError:
        return 0, ""


def counters(url: str) -> dict[str, float]:
    """afd_prefix_cache_{queries,hits}_total of the server's attention node."""
    text = _status(url + "/metrics")[1]
    out = {"queries": 0.0, "hits": 0.0}
    for line in text.splitlines():
        for k in out:
            if line.startswith(f"afd_prefix_cache_{k}_total{{"):
                out[k] += float(line.rsplit(" ", 1)[1])
    return out


def bench_args(argv: list[str]) -> argparse.Namespace:
    """`afd bench`'s arguments (afd.bench.serve), as its command line takes them."""
    p = argparse.ArgumentParser()
    bench_serve.add_parser(p.add_subparsers())
    return p.parse_args(["bench", *argv])


def _round(url: str, args, tmp: str, seed: int) -> dict:
    name = f"{url.rsplit(':', 1)[1]}-{seed}.json"
    before = counters(url)
    argv = ["--base-url", url, "--seed", str(seed), "--disable-tqdm", "--num-prompts", str(args.num_prompts)]
    argv += ["--shared-prefix-len", str(args.shared_prefix_len), "--random-input-len", str(args.input_len)]
    argv += ["--random-output-len", str(args.output_len), "--save-result", "--result-dir", tmp]
    with contextlib.redirect_stdout(io.StringIO()):
        bench_serve.run(bench_args([*argv, "--result-filename", name]))
    after = counters(url)
    r = json.loads(Path(tmp, name).read_text())
    row = {k: r[k] for k in KEYS}
    row["failed"] = r["failed"]
    row["hit_tokens"], row["query_tokens"] = (after[k] - before[k] for k in ("hits", "queries"))
    return row


def summarize(rounds: list[dict]) -> dict:
    """Per mode, each key's median over the rounds; per key, the median of each round's on / off ratio."""
    out: dict = {m: {} for m in MODES}
    for m in MODES:
        for k in (*KEYS, "hit_tokens", "query_tokens"):
            out[m][k] = statistics.median(r[m][k] for r in rounds)
        out[m]["hit_rate"] = statistics.median(r[m]["hit_tokens"] / max(1, r[m]["query_tokens"]) for r in rounds)
    out["on_over_off"] = {k: statistics.median(r["on"][k] / r["off"][k] for r in rounds if r["off"][k]) for k in KEYS}
    return out


def table(s: dict) -> str:
    lines = ["| metric | cache on | cache off | on / off (median of rounds) |", "|---|---|---|---|"]
    for k in KEYS:
        lines.append(f"| {k} | {s['on'][k]:.2f} | {s['off'][k]:.2f} | {s['on_over_off'][k]:.2f} |")
    for k in ("hit_tokens", "query_tokens", "hit_rate"):
        lines.append(f"| {k} (metric) | {s['on'][k]:.3g} | {s['off'][k]:.3g} | - |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="what `afd serve` serves (default: the demo checkpoint)")
    count_flag(ap, "--rounds", 7, 1, "measured rounds (after one warm-up round)")
    count_flag(ap, "--num-prompts", 8)
    count_flag(ap, "--shared-prefix-len", 256, 0)
    count_flag(ap, "--input-len", 32, 1, "each prompt's own tokens after the prefix")
    count_flag(ap, "--output-len", 16)
    count_flag(ap, "--max-num-batched-tokens", 512)
    ap.add_argument("--output", default=None, help="write the rounds and the summary as JSON here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, NodeProcesses(tmp) as procs:
        ports = dict(zip(MODES, free_ports(len(MODES))))
        urls = {m: f"http://127.0.0.1:{p}" for m, p in ports.items()}
        procs.start_all(_command(ports[m], m, args) for m in MODES)
        procs.wait_until(lambda: all(_status(u + "/health")[0] == 200 for u in urls.values()), 300, "afd serve")
        rounds: list[dict] = []
        for r in range(args.rounds + 1):
            order = MODES if r % 2 == 0 else MODES[::-1]
            res: dict[str, Any] = {m: _round(urls[m], args, tmp, 1000 + r) for m in order}
            res["order"], res["load_average"] = list(order), os.getloadavg()[0]
            if r:
                rounds.append(res)
            print(
                f"round {r}{' (warm-up)' if not r else ''}, load {res['load_average']:.1f}: "
                + ", ".join(
                    f"{m} ttft {res[m]['median_ttft_ms']:.0f} ms, hits {res[m]['hit_tokens']:.0f}/"
                    f"{res[m]['query_tokens']:.0f}"
                    for m in MODES
                ),
                flush=True,
            )
    s = summarize(rounds)
    print(table(s))
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "summary": s, "rounds": rounds}, indent=1))
    return 0 if all(r[m]["failed"] == 0 for r in rounds for m in MODES) else 1


if __name__ == "__main__":
    sys.exit(main())
