"""`afd bench-graph`: decode tokens/s in eager and graph mode (layout.graph_mode), colocated and 1A1F, and
graph compile time with a cold and a warm compile cache.

Decode: every (topology, batch, mode) runs the same dummy-weights job (prefill, then --steps measured decode
steps after the steps that compile); the cases are interleaved over --repeats rounds with the order rotating
each round; a figure is batch / the median measured step, then the median over rounds. Each job builds its
graphs anew (as every afd.LLM generate() and node start does), out of a compile cache the warm-up filled,
so the compile steps are a reload; they are skipped. Prompts of --prompt-len keep every block table in one
power-of-two width over the whole job (one set of graphs per batch). Colocated runs in this process on one
thread; 1A1F is two node processes of one thread each.

Compile time: two fresh processes compile the graphs of each batch bucket into a new cache directory (cold)
and then again from it (warm). --ffn: the FFN half's MoE layer eager vs compiled (afd/bench/graph_ffn.py).

--vs-hf: graph mode's speed target, AFD 1A1F vs HF transformers `generate`, and the bounds both sides have on
the cores they get, measured in the same run. Batch 16, prompts of 32, fp32, one real checkpoint (afd
bench-suite's decode setup: BENCH_CONFIG, random weights, safetensors). Cases, interleaved over --repeats
rounds with the order rotating:
- HF `generate` on 2 threads (decode tok/s from generate(N) minus generate(1));
- AFD 1A1F, one thread per node: eager, compiled (graph mode), and eager with row-major weights
  (AFD_CPU_ROW_MAJOR_WEIGHTS=1: without the CPU weight layout);
- the bounds: afd colocated on one thread, whose step is A + F (the attention half, then the MoE, on one
  core), and the FFN half alone on one thread at the same 16 tokens (F). Two cores cannot run a step in less
  than (A + F) / 2 however they share it, which is HF's ideal; AFD 1A1F overlaps its halves, so its ideal is
  max(A, F). What AFD can be over HF is therefore HF's step / max(A, F): it gains only what HF wastes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from afd.bench.common import Colocated, count_flag, interleaved, median, synthetic_prompts, write_config
from afd.bench.step import SCENARIOS, add_model_args
from afd.config.flags import DefaultsHelpFormatter

MODES = ("eager", "compile")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench-graph",
        help="decode tokens/s eager vs graph mode; compile time cold vs warm",
        formatter_class=DefaultsHelpFormatter,
    )
    add_model_args(p)
    p.add_argument("--batch-sizes", default="1,4,16,64", help="decode batches (each its own graph bucket)")
    p.add_argument("--topologies", default="colocated,1A1F", help="comma-separated subset of: colocated, 1A1F")
    count_flag(p, "--prompt-len", 70, 1, "70 + steps: block tables of 8 blocks of 16 throughout")
    count_flag(p, "--steps", 24, 1, "measured decode steps per run")
    count_flag(p, "--repeats", 3)
    p.add_argument("--no-compile-time", action="store_true", help="skip the cold/warm compile-time runs")
    p.add_argument("--vs-hf", action="store_true", help="also AFD 1A1F eager/compiled vs HF generate, batch 16")
    p.add_argument(
        "--ffn",
        action="store_true",
        help="also the FFN half's MoE layer eager vs compiled, at --batch-sizes tokens (afd/bench/graph_ffn.py)",
    )
    p.add_argument("--no-decode", action="store_true", help="skip the decode tokens/s runs")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.set_defaults(func=run)


def _skip(model: str) -> int:
    """Decode steps to leave out: graph mode compiles one graph per step (2 per layer)."""
    from afd.model.registry import load_config

    return 2 * load_config(model).num_layers + 1


def _tok_s(steps: list[dict], batch: int, skip: int, mean: bool = False) -> float:
    """batch / the median decode step (a median: other work on a shared machine lengthens some steps), or
    the mean one (against HF generate, which is timed as a whole)."""
    decode = [s["seconds"] for s in steps[1:] if s["tokens"] == batch][skip:]
    return batch / (sum(decode) / len(decode) if mean else median(decode))


def _afd_steps(model: str, prompts, new_tokens: int, mode: str, cache: str, dummy: bool = True) -> list[dict]:
    from afd.cluster.local import LocalCluster
    from afd.cluster.local_config import local_job

    job = local_job(
        model,
        1,
        1,
        dtype="float32",
        dummy_weights=dummy,
        micro_batches=1,
        graph_mode=mode,
        graph_batch_sizes=(len(prompts),),
        compile_cache_dir=cache,
    )
    with LocalCluster(job) as cluster:
        cluster.start(prompts, new_tokens, ignore_eos=True)
        _, reports = cluster.wait()
    return reports[0]["steps"]


def section_decode(args, model: str, cache: str) -> dict:
    from afd.engine.graph import GraphSettings

    batches = [int(b) for b in args.batch_sizes.split(",")]
    tops = [t.strip() for t in args.topologies.split(",")]
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    skip = _skip(model)
    n = skip + args.steps + 1
    colo = Colocated(model, dummy_weights=True)  # also the warm-up of the 1A1F runs' compile cache
    cases = {f"{t} b={b} {m}": (t, b, m) for t in tops for b in batches for m in MODES}

    def one(name: str, r: int) -> float:
        top, b, mode = cases[name]
        prompts = synthetic_prompts(b, args.prompt_len, vocab)
        if top == "colocated":
            steps = colo.generate(prompts, n, 1, GraphSettings(mode, (b,), cache)).steps
        else:
            steps = _afd_steps(model, prompts, n, mode, cache)
        return _tok_s(steps, b, skip)

    for b in batches:  # warm-up: the compile cache gets every job's graphs (the same shapes: the same job)
        colo.generate(synthetic_prompts(b, args.prompt_len, vocab), n, 1, GraphSettings("compile", (b,), cache))
    rounds = interleaved(list(cases), args.repeats, one, lambda m: print(f"  .. {m}", flush=True))
    return {
        "skip": skip,
        "steps": args.steps,
        "prompt_len": args.prompt_len,
        "results": {k: median(v) for k, v in rounds.items()},
        "rounds": rounds,
    }


COMPILE_PROBE = """
import json, sys
from afd.bench.common import Colocated, synthetic_prompts
from afd.engine.graph import GraphSettings
model, cache, batches, plen = sys.argv[1], sys.argv[2], [int(b) for b in sys.argv[3].split(",")], int(sys.argv[4])
colo, out = Colocated(model, dummy_weights=True), {}
for b in batches:
    steps = colo.generate(synthetic_prompts(b, plen, colo.cfg.vocab_size), 2 * colo.cfg.num_layers + 2, 1,
                          GraphSettings("compile", (b,), cache)).steps
    out[b] = sum(s["seconds"] for s in steps[1:])
print(json.dumps(out))
"""


def section_compile(args, model: str, tmp: str) -> dict:
    """Seconds of the decode steps that compile every graph of each bucket, in a fresh process: into an empty
    cache directory (cold), then again from it (warm)."""
    cache = os.path.join(tmp, "compile-probe")
    res = {}
    for kind in ("cold", "warm"):
        argv = [sys.executable, "-c", COMPILE_PROBE, model, cache, args.batch_sizes, str(args.prompt_len)]
        run = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=1800)
        res[kind] = {int(k): v for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items()}
    return res


def run(args) -> int:
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="afd-bench-graph-") as tmp:
        model = args.model or write_config(os.path.join(tmp, "model"), SCENARIOS[args.scenario])
        cache = os.path.join(tmp, "compile-cache")
        res: dict[str, Any] = {} if args.no_decode else {"decode": section_decode(args, model, cache)}
        if args.ffn:
            from afd.bench.graph_ffn import section_ffn

            res["ffn"] = section_ffn(model, [int(b) for b in args.batch_sizes.split(",")], args.repeats)
        if not args.no_compile_time:
            res["compile"] = section_compile(args, model, tmp)
        if args.vs_hf:
            res["vs_hf"] = section_vs_hf(args, tmp, cache)
    res["load_average"] = (load0, os.getloadavg()[0])
    _print(args, res, time.perf_counter() - t0)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k != "func"}, **res}, f, indent=2)
    return 0


def _print(args, res: dict, seconds: float) -> None:
    print(
        f"\n## afd bench-graph ({args.model or args.scenario}, {args.repeats} interleaved rounds, {os.cpu_count()} "
        f"CPUs, {seconds:.0f}s, 1-min load average {res['load_average'][0]:.1f} at start, "
        f"{res['load_average'][1]:.1f} at end)"
    )
    if "decode" in res:
        _print_decode(res["decode"])
    if "ffn" in res:
        from afd.bench.graph_ffn import print_ffn

        print_ffn(res["ffn"])
    _print_compile_and_hf(res)


def _print_decode(d: dict) -> None:
    print(
        f"\nDecode tokens/s (one thread per process; prompt {d['prompt_len']}, "
        f"{d['steps']} measured decode steps after {d['skip']} compiling ones; median of rounds):\n"
    )
    print("| topology | batch | eager tok/s | compile tok/s | compile / eager |")
    print("|---|---|---|---|---|")
    r = d["results"]
    for key in [k for k in r if k.endswith(" eager")]:
        top, b, _ = key.split(" ")
        e, c = r[key], r[key[: -len("eager")] + "compile"]
        print(f"| {top} | {b[2:]} | {e:.0f} | {c:.0f} | {c / e:.2f}x |")


def _print_compile_and_hf(res: dict) -> None:
    if "compile" in res:
        print(
            "\nCompile time of a bucket's graphs (every layer's pre_moe and post_moe, one width), seconds, in a "
            "fresh process (the first bucket also pays inductor's start-up):\n"
        )
        print("| batch bucket | cold cache | warm cache |")
        print("|---|---|---|")
        for b, cold in res["compile"]["cold"].items():
            print(f"| {b} | {cold:.1f} | {res['compile']['warm'][b]:.1f} |")
    if "vs_hf" in res:
        print_vs_hf(res["vs_hf"])


# ---- --vs-hf ----

B, P = 16, 32
ROW_MAJOR = "afd 1A1F eager, row-major weights"


def section_vs_hf(args, tmp: str, cache: str) -> dict:
    from afd.backend.cpu import ROW_MAJOR_ENV
    from afd.bench.suite import _HF, HF_CONFIG
    from afd.model.demo import write_checkpoint

    path = os.path.join(tmp, "hf-ckpt")
    write_checkpoint(path, HF_CONFIG, seed=0)
    skip = _skip(path)
    n = skip + args.steps + 1
    prompts = synthetic_prompts(B, P, HF_CONFIG["vocab_size"])
    hf, colo = _HF(path), Colocated(path)
    hf.generate(prompts, 2, 2)  # warm-up
    _afd_steps(path, prompts, n, "compile", cache, dummy=False)  # fills the compile cache (the same job's shapes)
    ffn_step = _ffn_step(colo)

    def one(name: str, r: int) -> float:
        if name == "HF transformers generate":
            _, t_n = hf.generate(prompts, n, threads=2)
            _, t_1 = hf.generate(prompts, 1, threads=2)
            return B * (n - 1) / (t_n - t_1)
        if name == "afd colocated, 1 thread (A + F)":
            return _tok_s(colo.generate(prompts, n, 1).steps, B, 2, mean=True)
        if name == "FFN half alone, 1 thread (F)":
            return B / ffn_step()
        if name == ROW_MAJOR:
            os.environ[ROW_MAJOR_ENV] = "1"  # the node processes inherit it
        try:
            mode = name.split()[2].rstrip(",")
            return _tok_s(_afd_steps(path, prompts, n, mode, cache, dummy=False), B, skip, mean=True)
        finally:
            os.environ.pop(ROW_MAJOR_ENV, None)

    names = [
        "HF transformers generate",
        "afd 1A1F eager",
        "afd 1A1F compile",
        ROW_MAJOR,
        "afd colocated, 1 thread (A + F)",
        "FFN half alone, 1 thread (F)",
    ]
    rounds = interleaved(names, args.repeats, one, lambda m: print(f"  .. {m}", flush=True))
    return {k: median(v) for k, v in rounds.items()} | {"rounds": rounds}


def _ffn_step(colo: Colocated):
    """A function timing one decode step's MoE on the FFN half (every MoE layer at B tokens, one thread):
    the median of 20 steps, in seconds."""
    import torch

    x = torch.randn(B, colo.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    layers = list(colo.cfg.moe_layers)

    def step() -> float:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                for i in layers:
                    colo.ffn(colo.backend, i, x)
                times.append(time.perf_counter() - t0)
            return median(times)
        finally:
            torch.set_num_threads(before)

    return step


def print_vs_hf(v: dict) -> None:
    hf = v["HF transformers generate"]
    print(
        "\nThe issue's speed target: batch 16, fp32, AFD 1A1F (1 thread per node) vs HF generate (2 threads), "
        "decode tokens/s, and the bounds from the same run:\n"
    )
    print("| case | tok/s | ms / step | vs HF |")
    print("|---|---|---|---|")
    for k in [k for k in v if k != "rounds"]:
        print(f"| {k} | {v[k]:.0f} | {1e3 * B / v[k]:.1f} | {v[k] / hf:.2f}x |")
    both, f = B / v["afd colocated, 1 thread (A + F)"], B / v["FFN half alone, 1 thread (F)"]
    a = both - f
    print(
        f"\nA = {1e3 * a:.1f} ms, F = {1e3 * f:.1f} ms: two cores' ideal step (A + F) / 2 = {500 * both:.1f} ms, "
        f"AFD 1A1F's ideal max(A, F) = {1e3 * max(a, f):.1f} ms. HF runs at {both / 2 / (B / hf):.2f} of its "
        f"ideal; AFD 1A1F at its ideal would be {(B / max(a, f)) / hf:.2f}x HF."
    )
