"""`afd bench-graph --vs-hf`: graph mode's speed target, AFD 1A1F vs HF transformers `generate`, and the bounds
both sides have on the cores they get, measured in the same run.

Batch 16, prompts of 32, fp32, one real checkpoint (afd bench-suite's decode setup: BENCH_CONFIG, random
weights, safetensors). Cases, interleaved over --repeats rounds with the order rotating:
- HF `generate` on 2 threads (decode tok/s from generate(N) minus generate(1));
- AFD 1A1F, one thread per node: eager, compiled (graph mode), and eager with row-major weights
  (AFD_CPU_ROW_MAJOR_WEIGHTS=1: without the CPU weight layout);
- the bounds: afd colocated on one thread, whose step is A + F (the attention half, then the MoE, on one
  core), and the FFN half alone on one thread at the same 16 tokens (F). Two cores cannot run a step in less
  than (A + F) / 2 however they share it, which is HF's ideal; AFD 1A1F overlaps its halves, so its ideal is
  max(A, F). What AFD can be over HF is therefore HF's step / max(A, F): it gains only what HF wastes.
"""

from __future__ import annotations

import os
import time

from afd.bench.common import Colocated, interleaved, median, synthetic_prompts

B, P = 16, 32
ROW_MAJOR = "afd 1A1F eager, row-major weights"


def section_vs_hf(args, tmp: str, cache: str) -> dict:
    from afd.backend.cpu import ROW_MAJOR_ENV
    from afd.bench.graph import _afd_steps, _skip, _tok_s
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
