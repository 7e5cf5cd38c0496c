"""Soak: `afd bench` rounds against a launched demo cluster for N minutes at C concurrent streams.

Reports failed requests, each node's RSS at the start (after a warm-up round) and at the end, and the
running / waiting / KV-usage gauges once the load stops. The issue's bar: 0 failures, RSS growth < 5 %,
gauges back to 0.

    python bench/soak.py --minutes 10 --concurrency 64 --output docs/bench/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from afd.cluster.processes import descendants, free_ports


def _cluster(tmp: str) -> tuple[str, str]:
    c = iter(free_ports(6))
    doc = {
        "cluster": {"name": "soak"},
        "model": {"path": "demo"},
        "engine": {"kv_cache_bytes": "64MiB", "max_num_seqs": 64},
        "nodes": [
            {
                "name": "attn0",
                "role": "attention",
                "host": "127.0.0.1",
                "ports": {"control": next(c), "data": next(c), "http": next(c)},
            },
            {
                "name": "ffn0",
                "role": "ffn",
                "host": "127.0.0.1",
                "ports": {"control": next(c), "data": next(c), "metrics": next(c)},
            },
        ],
    }
    path = os.path.join(tmp, "soak.yaml")
    Path(path).write_text(yaml.safe_dump(doc))
    return path, f"http://127.0.0.1:{doc['nodes'][0]['ports']['http']}"


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _node_pids(launcher: int) -> dict[str, int]:
    out = {}
    for pid in descendants(launcher):
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--node" in cmd:
            out[cmd[cmd.index(b"--node") + 1].decode()] = pid
    return out


def _gauges(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    names = ("afd_num_requests_running", "afd_num_requests_waiting", "afd_kv_cache_usage_ratio")
    return {n: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() for n in names if line.startswith(n + "{")}


def _round(url: str, args, tmp: str, n: int, seed: int) -> dict:
    out = os.path.join(tmp, f"round{seed}.json")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "afd",
            "bench",
            "--base-url",
            url,
            "--num-prompts",
            str(n),
            "--max-concurrency",
            str(args.concurrency),
            "--random-input-len",
            "32",
            "--random-output-len",
            "32",
            "--vocab-size",
            "512",
            "--seed",
            str(seed),
            "--save-result",
            "--result-dir",
            tmp,
            "--result-filename",
            os.path.basename(out),
            "--disable-tqdm",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(Path(out).read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--round-prompts", type=int, default=256, help="requests per afd bench round")
    ap.add_argument("--output", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path, url = _cluster(tmp)
        launcher = subprocess.Popen(
            [sys.executable, "-m", "afd", "launch", path],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            while not (launcher.stdout.readline() or "").startswith("http://"):
                assert launcher.poll() is None, "the cluster did not start"
            _round(url, args, tmp, args.concurrency * 2, 0)  # warm-up: allocator pools, caches
            pids = _node_pids(launcher.pid)
            start = {n: _rss(p) for n, p in pids.items()}
            rounds, t0, seed = [], time.monotonic(), 1
            while time.monotonic() - t0 < args.minutes * 60:
                r = _round(url, args, tmp, args.round_prompts, seed)
                rounds.append({k: r[k] for k in ("completed", "failed", "duration", "output_throughput")})
                rounds[-1]["rss"] = {n: _rss(p) for n, p in pids.items()}
                print(
                    f"round {seed}: {r['completed']} ok, {r['failed']} failed, {r['output_throughput']:.0f} tok/s, "
                    f"RSS {', '.join(f'{n} {v / 2**20:.0f} MiB' for n, v in rounds[-1]['rss'].items())}",
                    flush=True,
                )
                seed += 1
            time.sleep(2)
            gauges = _gauges(url)
            end = {n: _rss(p) for n, p in pids.items()}
        finally:
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(60)
    result = {
        "minutes": round((time.monotonic() - t0) / 60, 2),
        "concurrency": args.concurrency,
        "requests": sum(r["completed"] + r["failed"] for r in rounds),
        "failed": sum(r["failed"] for r in rounds),
        "rss_start_mib": {n: round(v / 2**20, 1) for n, v in start.items()},
        "rss_end_mib": {n: round(v / 2**20, 1) for n, v in end.items()},
        "rss_growth": {n: round(end[n] / start[n] - 1, 4) for n in start},
        "gauges_after": gauges,
        "rounds": rounds,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    ok = result["failed"] == 0 and all(g < 0.05 for g in result["rss_growth"].values()) and not any(gauges.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
