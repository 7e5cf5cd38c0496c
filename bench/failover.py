"""Fault injection: kill -9 each node of a running cluster under streaming load, and measure what the
survivors and the clients saw.

A cluster YAML (default deploy/2a1f.yaml, its ports moved to free ones) runs either under `afd launch`,
which must restart a dead node by itself, or as the commands `afd launch --print-commands` prints, each
started on its own as a user would in another shell, a dead one started again by its printed command.
Every attention node serves `--streams` greedy streaming completions at once, back to back, from a fixed
set of prompts whose tokens are first recorded with no fault. Then, one node after another (`--kill`), the
node's process is killed with SIGKILL while the load runs, and the script waits until it serves again.

Per kill it reports: the largest gap between two chunks of one stream (its start counts as one) on every
attention node that was not killed, while the node was down and rejoining (the "pause"); requests done and
failed on each node (a killed attention node's own streams die with it: their connections are gone); whether
every completed stream's tokens equal the fault-free ones; and the time from the kill until the node
answered again and until `afd status` said READY.

    python bench/failover.py --launcher launch --output docs/bench/failover-launch.json
    python bench/failover.py --launcher hand --output docs/bench/failover-hand.json
    python bench/failover.py --kill "" --big-prompt 30 --output docs/bench/failover-big-prompt.json
    python bench/failover.py --config deploy/1a2f.yaml --kill ffn1,ffn0 --output docs/bench/failover-1a2f.json

With `--hostile` (and `--kill ""`), hostile input goes to the first attention node while every one
streams, behind an API key: `/detokenize` without the key, large bodies (a 10^6-entry logit_bias, 300k chat
messages, 1M text parts, 3M stop_token_ids) one at a time, then eight 100k-string `choice` requests at once with a
plain 1-token request meanwhile; each answer's status and time, and the streams' largest gap.

    python bench/failover.py --kill "" --hostile --output docs/bench/failover-hostile.json

With `--rebalance`, `afd rebalance --apply` runs under the load (`--launcher launch`, whose restarts load the
new placement), reporting the fewest holders of any expert before and after, and the streams' largest gap.

    python bench/failover.py --config deploy/1a3f-replicated.yaml --kill "" --rebalance \\
        --output docs/bench/failover-rebalance.json

With `--big-prompt MB`, a text prompt that large then goes to the last attention node while the others
stream: its status, the others' largest gap, and the node's RSS before and a minute after.

With `--hang SECONDS`, each node is stopped (SIGSTOP: alive, its sockets open) instead of killed, and continued
(SIGCONT) that many seconds later. Besides the pause, a row then says how long after SIGCONT the cluster served
a new request on every attention node, and whether `/health` and `afd status` ever disagreed: both are polled
every 0.5 s from the stop until the end (a node's /health 200 while the status names it lost or paused, or a
503 while the status says READY).

    python bench/failover.py --hang 30 --kill attn1 --output docs/bench/failover-hang-attn1.json
    python bench/failover.py --config deploy/2a1f.yaml --hang 100 --kill ffn0 \\
        --output docs/bench/failover-hang-ffn0.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cluster_load import (
    HEADERS,
    Agreement,
    Cluster,
    Load,
    afd_command,
    answers,
    cluster_copy,
    cluster_ready,
    node_back,
    serves,
    summary,
    wait_for,
)

from afd.bench.streams import stream_timed


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _big_prompt(cluster: Cluster, attention: dict[str, str], prompts, args, refs) -> dict:
    """A text prompt of `--big-prompt` MB to the last attention node while the others stream: its status and
    time, the others' largest gap, and the node's RSS before, and a minute after."""
    target, url = list(attention.items())[-1]
    others = {n: u for n, u in attention.items() if n != target}
    pid = cluster.pid(target)
    assert pid is not None
    before = _rss(pid)
    loads = {n: Load(u, prompts, args.max_tokens, args.streams) for n, u in others.items()}
    time.sleep(3)
    body = json.dumps({"prompt": "afd " * (args.big_prompt * 2**20 // 4), "max_tokens": 4}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    took = time.monotonic() - t0
    time.sleep(2)
    t1 = time.monotonic()
    for load in loads.values():
        load.join()
    time.sleep(60)
    return {
        "big_prompt_mb": args.big_prompt,
        "to": target,
        "status": status,
        "answered_after_s": round(took, 2),
        "rss_before_mib": round(before / 2**20, 1),
        "rss_a_minute_later_mib": round(_rss(pid) / 2**20, 1),
        "nodes": {n: summary(load.records, refs, t0, t1, args.max_tokens) for n, load in loads.items()},
    }


HOSTILE = {
    # large bodies, each legal JSON, each past a bound vLLM users would expect: a 400
    "logit_bias of 10^6 entries": ("/v1/completions", lambda m: {"logit_bias": {str(i): 1 for i in range(10**6)}}),
    "chat of 300k messages": (
        "/v1/chat/completions",
        lambda m: {"messages": [{"role": "user", "content": "hi"}] * 300_000},
    ),
    "1M text parts": (
        "/v1/chat/completions",
        lambda m: {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 10**6}]},
    ),
    "3M stop_token_ids": ("/v1/completions", lambda m: {"stop_token_ids": [1] * 3_000_000}),
}
GRAMMARS, CHOICES = 8, 100_000
"""This many `structured_outputs.choice` requests of this many strings at once."""


def _post(url: str, path: str, body: dict | bytes, headers: dict, timeout: float = 120) -> tuple[int, float]:
    """(HTTP status, seconds from the first byte sent to the answer); `body` JSON, or already encoded."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json", **headers})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status, time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, time.monotonic() - t0


def _hostile(attention: dict[str, str], prompts, args, refs) -> dict:
    """Hostile input against the first attention node while every attention node streams: /detokenize
    without the API key; HOSTILE's bodies, one at a time (status, time); GRAMMARS choice requests at once with a
    plain 1-token request sent meanwhile (each status and time); the streams' largest gap over it all."""
    name, url = next(iter(attention.items()))
    encoded = {}  # before the load: encoding them is the benchmark's own CPU (seconds), not the node's
    for what, (path, make) in HOSTILE.items():
        base = {"prompt": "hi"} if path == "/v1/completions" else {}
        encoded[what] = path, json.dumps({**base, "max_tokens": 1, **make(None)}).encode()
    choices = {"choice": [f"option {i}" for i in range(CHOICES)]}
    choice = json.dumps({"prompt": "pick one", "max_tokens": 4, "structured_outputs": choices}).encode()
    loads = {n: Load(u, prompts, args.max_tokens, args.streams) for n, u in attention.items()}
    time.sleep(3)
    t0 = time.monotonic()
    out: dict = {"to": name}
    out["detokenize_without_key"] = _post(url, "/detokenize", {"tokens": [1, 2, 3]}, {})[0]
    bodies = {}
    for what, (path, data) in encoded.items():
        status, took = _post(url, path, data, HEADERS)
        bodies[what] = {"status": status, "answered_after_s": round(took, 3), "mib": round(len(data) / 2**20, 1)}
    out["bodies"] = bodies
    with ThreadPoolExecutor(GRAMMARS + 1) as pool:
        grammars = [pool.submit(_post, url, "/v1/completions", choice, HEADERS) for _ in range(GRAMMARS)]
        time.sleep(0.2)
        plain = pool.submit(_post, url, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, HEADERS).result()
        got = [f.result() for f in grammars]
    out["grammars"] = {
        "statuses": sorted({s for s, _ in got}),
        "slowest_s": round(max(t for _, t in got), 3),
        "plain_1_token": {"status": plain[0], "answered_after_s": round(plain[1], 3)},
    }
    time.sleep(2)
    t1 = time.monotonic()
    for load in loads.values():
        load.join()
    out["nodes"] = {n: summary(load.records, refs, t0, t1, args.max_tokens) for n, load in loads.items()}
    return out


def _rebalance(path: str, attention: dict[str, str], prompts, args, refs) -> dict:
    """`afd rebalance --apply` while every attention node streams (after a warm-up whose expert
    loads the FFN nodes' metrics count): its exit code and time, the fewest holders any expert has in the
    placement it wrote against the fewest before, and the streams' largest gap."""
    from afd.cluster.topology import model_dir
    from afd.config.loader import load as load_cluster
    from afd.model.registry import load_config

    def fewest_holders() -> int:
        cfg = load_cluster(path)
        placement = cfg.placement(load_config(model_dir(cfg)).n_routed_experts)
        return min(sum(e in held for held in placement.held) for e in range(placement.n_routed))

    before = fewest_holders()
    loads = {n: Load(u, prompts, args.max_tokens, args.streams) for n, u in attention.items()}
    time.sleep(5)
    t0 = time.monotonic()
    r = subprocess.run(afd_command("rebalance", path, "--apply"), capture_output=True, text=True, timeout=900)
    took = time.monotonic() - t0
    time.sleep(args.settle)
    t1 = time.monotonic()
    for load in loads.values():
        load.join()
    return {
        "rebalance_apply": {"returncode": r.returncode, "seconds": round(took, 1), "tail": r.stdout[-600:]},
        "fewest_holders": {"before": before, "after": fewest_holders()},
        "nodes": {n: summary(load.records, refs, t0, t1, args.max_tokens) for n, load in loads.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="deploy/2a1f.yaml")
    ap.add_argument("--launcher", choices=("launch", "hand"), default="launch")
    ap.add_argument("--kill", default=None, help="comma-separated nodes, in order (default: every node)")
    ap.add_argument("--streams", type=int, default=16, help="concurrent streams per attention node")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--settle", type=float, default=5.0, help="seconds of load after the node is back")
    ap.add_argument("--big-prompt", type=int, default=0, help="then send a text prompt of this many MB (0: none)")
    ap.add_argument("--hang", type=float, default=0, help="stop each node (SIGSTOP) this long instead of killing it")
    ap.add_argument("--hostile", action="store_true", help="then hostile input (see the docstring)")
    ap.add_argument("--rebalance", action="store_true", help="then `afd rebalance --apply` under the load")
    ap.add_argument("--output", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if args.hostile:  # behind an API key, as /detokenize's row needs; the launcher hands it to the nodes
        os.environ["AFD_API_KEY"] = key = f"bench-{random.randrange(1 << 64):x}"
        HEADERS["Authorization"] = f"Bearer {key}"
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(4, 24))] for _ in range(args.streams)]
    with tempfile.TemporaryDirectory() as tmp:
        path, doc = cluster_copy(args.config, tmp)
        attention = {n["name"]: f"http://{n['host']}:{n['ports']['http']}" for n in doc["nodes"] if n["role"] != "ffn"}
        kills = [n["name"] for n in doc["nodes"]] if args.kill is None else [k for k in args.kill.split(",") if k]
        cluster = Cluster(path, args.launcher)
        results = []
        try:
            up = lambda: cluster_ready(path, doc) and all(answers(u + "/health") for u in attention.values())  # noqa: E731
            assert wait_for("cluster READY", up, 300) is not None, "the cluster did not start"
            refs = {}
            for i, p in enumerate(prompts):  # fault-free tokens, one at a time on the first node
                body = {"prompt": p, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
                refs[i] = stream_timed(next(iter(attention.values())), body, timeout=120, headers=HEADERS)["ids"]
            for node in kills:
                loads = {n: Load(u, prompts, args.max_tokens, args.streams) for n, u in attention.items()}
                time.sleep(3)
                t_kill = time.monotonic()
                if args.hang:
                    agree = Agreement(path, attention, node, time.monotonic() + args.hang)
                    pid = cluster.hang(node, args.hang)
                    print(f"{args.launcher}: stopped {node} (pid {pid}) for {args.hang:g}s", flush=True)
                    time.sleep(args.hang)
                    serving = lambda: all(serves(u, prompts[0]) for u in attention.values())  # noqa: E731
                    back = wait_for("serving after SIGCONT", serving, 180)
                else:
                    pid = cluster.kill(node)
                    print(f"{args.launcher}: killed {node} (pid {pid})", flush=True)
                    back = wait_for(f"{node} back", lambda n=node, old=pid: node_back(cluster, n, old, attention), 180)
                ready = wait_for("READY", lambda: cluster_ready(path, doc), 120)
                time.sleep(args.settle)
                t_end = time.monotonic()
                for load in loads.values():
                    load.join()
                row = {
                    "stopped_s" if args.hang else "killed": args.hang if args.hang else node,
                    **({"stopped": node} if args.hang else {}),
                    "launcher": args.launcher,
                    ("serving_after_cont_s" if args.hang else "back_after_s"): None if back is None else round(back, 1),
                    "ready_after_s": None if ready is None else round((back or 0) + ready, 1),
                    "nodes": {
                        n: summary(load.records, refs, t_kill, t_end, args.max_tokens) for n, load in loads.items()
                    },
                }
                if args.hang:
                    row["health_vs_status"] = agree.join()
                results.append(row)
                print(json.dumps(row), flush=True)
            if args.hostile:
                results.append(_hostile(attention, prompts, args, refs))
                print(json.dumps(results[-1]), flush=True)
            if args.rebalance:
                results.append(_rebalance(path, attention, prompts, args, refs))
                print(json.dumps(results[-1]), flush=True)
            if args.big_prompt:
                results.append(_big_prompt(cluster, attention, prompts, args, refs))
                print(json.dumps(results[-1]), flush=True)
        finally:
            cluster.stop()
    out = {"config": args.config, "streams_per_node": args.streams, "max_tokens": args.max_tokens, "runs": results}
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
