"""`afd bench-suite`: grouped-GEMM experts, decode throughput against HF transformers, and AFD scaling.

Three sections, each comparing its variants side by side in one run (interleaved rounds, medians):
  gemm     one MoE layer of BENCH_CONFIG on one thread: afd's grouped GEMM over tokens sorted by expert
           vs the per-expert loop of HF's LongcatFlashExperts vs every token through every expert;
  decode   decode tokens/s of AFD 1A1F, colocated afd and HF `generate` on the same checkpoint;
  scaling  AFD decode step time vs batch per attention node, and 1A1F vs 2A1F (one FFN node serving two);
  prefetch FFN layer time with and without weight prefetch in a replayed communication gap (afd.bench.prefetch).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

from afd.bench.common import Colocated, count_flag, interleaved, median, run_afd, synthetic_prompts, write_config
from afd.bench.gemm import _print_gemm, section_gemm
from afd.bench.step import BENCH_CONFIG, _summarize
from afd.config.flags import DefaultsHelpFormatter

SECTIONS = ("gemm", "prefetch", "decode", "scaling")
AFD_MODE: dict[str, Any] = dict(overlap=True, micro_batches=1)  # run_afd's keywords
"""AFD runs use overlap with one micro-batch (`afd bench-step` measures the other modes)."""
HF_CONFIG = {
    **BENCH_CONFIG,
    "architectures": ["LongcatFlashForCausalLM"],
    "max_position_embeddings": 512,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "dtype": "float32",
}
"""BENCH_CONFIG as a complete HF config.json (HF's defaults for the missing keys differ from afd's)."""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench-suite",
        help="grouped GEMM, decode throughput vs HF transformers, AFD scaling",
        formatter_class=DefaultsHelpFormatter,
    )
    count_flag(p, "--repeats", 3, 1, "interleaved rounds per comparison")
    p.add_argument("--quick", action="store_true", help="fewer steps and sizes (a smoke test)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of: " + ", ".join(SECTIONS))
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.set_defaults(func=run)


def _log(msg: str) -> None:
    print(f"  .. {msg}", flush=True)


# --- (2) decode throughput vs HF transformers ----------------------------------------------------------


class _HF:
    """LongcatFlashForCausalLM from the checkpoint; greedy generate on a batch of equal-length prompts."""

    def __init__(self, path: str):
        import torch
        import transformers
        from transformers import LongcatFlashForCausalLM

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        self.model = LongcatFlashForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None  # like afd's ignore_eos
        self.model.generation_config.pad_token_id = 0

    def generate(self, prompts: list[list[int]], new_tokens: int, threads: int):
        import torch

        ids = torch.tensor(prompts)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            t0 = time.perf_counter()
            with torch.inference_mode():
                seq = self.model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False
                )
            return seq[:, ids.shape[1] :].tolist(), time.perf_counter() - t0
        finally:
            torch.set_num_threads(before)


def _decode_setup(tmp: str, quick: bool):
    B, P, N = (4, 16, 6) if quick else (32, 32, 32)
    path = os.path.join(tmp, "ckpt")
    from afd.model.demo import write_checkpoint

    write_checkpoint(path, HF_CONFIG, seed=0)
    return path, synthetic_prompts(B, P, HF_CONFIG["vocab_size"]), N


def _afd_decode_round(run) -> dict:
    d = run.decode_steps()
    return {
        "tok_s": run.decode_tokens_per_s(),
        "step_ms": 1e3 * sum(s["seconds"] for s in d) / len(d),
        "prefill_ms": 1e3 * run.steps[0]["seconds"],
        "timed_fraction": sum(s["seconds"] for s in run.steps) / run.wall_seconds if run.wall_seconds else None,
    }


def section_decode(args, tmp: str) -> dict:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("\n(decode: HF transformers is not installed; `pip install afd[test]` to compare against it)")
        return {"skipped": "transformers not installed"}
    path, prompts, N = _decode_setup(tmp, args.quick)
    B = len(prompts)
    colo, hf = Colocated(path), _HF(path)
    for threads in (1, 2):  # warm-up (lazy initialisation, thread pools)
        hf.generate(prompts, 2, threads)
        colo.generate(prompts, 2, threads)
    outputs: dict[str, list] = {}

    def one(name: str, r: int) -> dict:
        if name == "HF transformers generate":
            toks, t_n = hf.generate(prompts, N, threads=2)
            _, t_1 = hf.generate(prompts, 1, threads=2)
            outputs.setdefault(name, toks)
            return {
                "tok_s": B * (N - 1) / (t_n - t_1),
                "step_ms": 1e3 * (t_n - t_1) / (N - 1),
                "prefill_ms": 1e3 * t_1,
                "timed_fraction": None,
            }
        run = (
            run_afd(path, prompts, N, **AFD_MODE)
            if name.startswith("afd 1A1F")
            else colo.generate(prompts, N, threads=DECODE_VARIANTS[name])
        )
        outputs.setdefault(name, run.outputs)
        return _afd_decode_round(run)

    rounds = interleaved(list(DECODE_VARIANTS), args.repeats, one, _log)
    res = {k: {m: median(x[m] for x in v) if v[0][m] is not None else None for m in v[0]} for k, v in rounds.items()}
    hf_out, colo_out = outputs["HF transformers generate"], outputs["afd colocated"]
    return {
        "batch": B,
        "prompt_len": len(prompts[0]),
        "new_tokens": N,
        "results": res,
        "rounds": rounds,
        "same_tokens_colocated_vs_hf": [a == b for a, b in zip(colo_out, hf_out)],
        "first_divergence_vs_hf": [_diverge(a, b) for a, b in zip(colo_out, hf_out)],
        "same_tokens_afd_vs_colocated": [a == b for a, b in zip(outputs["afd 1A1F"], colo_out)],
    }


DECODE_VARIANTS = {"afd 1A1F": 1, "afd colocated": 2, "afd colocated (1 thread)": 1, "HF transformers generate": 2}
"""Variant -> torch threads (the AFD figure is per node: two processes, one thread each)."""


def _diverge(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _print_decode(res: dict) -> None:
    if "skipped" in res:
        return
    r, hf = res["results"], res["results"]["HF transformers generate"]["tok_s"]
    print(
        f"\n### Decode throughput vs HF transformers\n\nSame checkpoint (BENCH_CONFIG, fp32, written by "
        f"afd.model.demo.write_checkpoint), batch {res['batch']}, prompt {res['prompt_len']}, "
        f"{res['new_tokens']} new tokens, greedy. Decode tokens/s excludes prefill: afd sums its per-step "
        f"timings over the {res['new_tokens'] - 1} decode steps; HF is generate(max_new_tokens="
        f"{res['new_tokens']}) minus generate(max_new_tokens=1), which is also its prefill column. "
        "Median of interleaved rounds.\n"
    )
    print("| engine | processes x torch threads | decode tokens/s | mean decode step (ms) | prefill (ms) | vs HF |")
    print("|---|---|---|---|---|---|")
    procs = {
        "afd 1A1F": "2 x 1 (overlap, m=1)",
        "afd colocated": "1 x 2",
        "afd colocated (1 thread)": "1 x 1",
        "HF transformers generate": "1 x 2",
    }
    for k, v in r.items():
        print(
            f"| {k} | {procs[k]} | {v['tok_s']:.0f} | {v['step_ms']:.2f} | {v['prefill_ms']:.1f} | "
            f"{v['tok_s'] / hf:.2f}x |"
        )
    same, div = res["same_tokens_colocated_vs_hf"], res["first_divergence_vs_hf"]
    first = "identical" if same[0] else f"diverge at token {div[0]}"
    print(
        f"\nGreedy tokens, afd colocated vs HF (fp32): {sum(same)}/{len(same)} prompts identical over "
        f"{res['new_tokens']} tokens (prompt 0: {first}). AFD 1A1F vs colocated: "
        f"{sum(res['same_tokens_afd_vs_colocated'])}/{len(same)} identical."
    )
    timed = r["afd colocated"]["timed_fraction"]
    if timed:
        print(
            f"(afd's per-step timings cover the forward passes only: {100 * timed:.1f}% of the colocated "
            "generate() wall time; the rest is sampling and bookkeeping, prefill included.)"
        )


# --- (3) scaling ---------------------------------------------------------------------------------------


def _scaling_cases(quick: bool) -> dict[str, tuple[int, int]]:
    """name -> (attention nodes, batch per attention node)."""
    if quick:
        return {"1A1F b=4": (1, 4), "2A1F b=4": (2, 4)}
    return {"1A1F b=4": (1, 4), "1A1F b=16": (1, 16), "1A1F b=64": (1, 64), "2A1F b=16": (2, 16)}


def _scaling_round(model: str, A: int, B: int, P: int, N: int) -> dict:
    run = run_afd(
        model, synthetic_prompts(A * B, P, BENCH_CONFIG["vocab_size"]), N, A, 1, dummy_weights=True, **AFD_MODE
    )
    ffn, L = run.ffn, BENCH_CONFIG["num_layers"]
    s = _summarize([dict(x, ffn_busy=None) for x in run.steps], B)
    return {
        "step_ms": s["step_ms"],
        "wait_fraction": s["wait_fraction"],
        "ffn_tokens_per_step": (ffn["tokens"] / L - A * B * P) / max(1, ffn["steps"] - 1),
        "ffn_busy": ffn["compute_seconds"] / max(1e-9, ffn["compute_seconds"] + ffn["idle_seconds"]),
    }


def section_scaling(args, tmp: str) -> dict:
    model = write_config(os.path.join(tmp, "scaling"), BENCH_CONFIG)
    P, N = (16, 6) if args.quick else (32, 24)
    cases = _scaling_cases(args.quick)
    rounds = interleaved(list(cases), args.repeats, lambda n, r: _scaling_round(model, *cases[n], P, N), _log)
    res = {
        k: {m: median(x[m] for x in v) for m in v[0]} | {"attention_nodes": cases[k][0], "batch": cases[k][1]}
        for k, v in rounds.items()
    }
    return {"prompt_len": P, "new_tokens": N, "cpus": os.cpu_count(), "results": res, "rounds": rounds}


def _print_scaling(res: dict) -> None:
    print(
        f"\n### AFD scaling (dummy BENCH_CONFIG weights, overlap m=1, 1 thread per node)\n\nPrompt "
        f"{res['prompt_len']}, {res['new_tokens']} new tokens; decode step = median over steps (warm-up "
        "skipped), then over interleaved rounds. FFN tokens per step = MoE tokens the FFN node got per "
        "decode step and layer.\n"
    )
    print(
        "| topology | batch per attention node | decode step (ms) | tokens/s per attention node | "
        "tokens/s total | FFN tokens per step | FFN busy | attention waiting on FFN |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for v in res["results"].values():
        A, B = v["attention_nodes"], v["batch"]
        per = 1e3 * B / v["step_ms"]
        print(
            f"| {A}A1F | {B} | {v['step_ms']:.2f} | {per:.0f} | {A * per:.0f} | {v['ffn_tokens_per_step']:.0f} | "
            f"{100 * v['ffn_busy']:.0f}% | {100 * v['wait_fraction']:.1f}% |"
        )
    procs = max(v["attention_nodes"] for v in res["results"].values()) + 1
    if procs > (res["cpus"] or 1):
        print(
            f"\nNote: {procs} node processes on {res['cpus']} CPU cores oversubscribe the machine in the "
            "2A1F rows: its step times include waiting for a core, so they understate what 2A1F does on "
            "dedicated hardware."
        )


def _print_prefetch(results: dict) -> None:
    from afd.bench.prefetch import format_prefetch

    print("\n### FFN weight prefetch on CPU (1 thread, 8 layers)\n\n" + format_prefetch(results))


def section_prefetch(args, tmp: str) -> dict:
    tokens = (8,) if args.quick else (8, 32)
    from afd.bench.prefetch import run_prefetch_bench  # imports torch: not for `afd --help`

    return run_prefetch_bench(tokens, repeats=2 if args.quick else 2 * args.repeats, num_layers=4 if args.quick else 8)


RUNNERS = {
    "gemm": lambda args, tmp: section_gemm(args),
    "prefetch": section_prefetch,
    "decode": section_decode,
    "scaling": section_scaling,
}


# --- driver --------------------------------------------------------------------------------------------


def run(args) -> int:
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="afd-bench-suite-") as tmp:
        for s in sections:
            print(f"[{s}] running ...", flush=True)
            results[s] = RUNNERS[s](args, tmp)
    load = (load0, os.getloadavg()[0])
    print(
        f"\n## afd bench-suite ({'quick, ' if args.quick else ''}{args.repeats} interleaved rounds, "
        f"{os.cpu_count()} CPUs, {time.perf_counter() - t0:.0f}s, 1-min load average {load[0]:.1f} at "
        f"start, {load[1]:.1f} at end)"
    )
    printers = {
        "gemm": _print_gemm,
        "decode": _print_decode,
        "scaling": _print_scaling,
        "prefetch": _print_prefetch,
    }
    for s in sections:
        printers[s](results[s])
    if args.output:
        with open(args.output, "w") as f:
            json.dump(
                {
                    "config": {k: v for k, v in vars(args).items() if k != "func"},
                    "cpus": os.cpu_count(),
                    "load_average": load,
                    **results,
                },
                f,
                indent=2,
            )
    ok = all(r["grouped_equals_naive"] for r in results.get("gemm", {}).values())
    return 0 if ok else 1
