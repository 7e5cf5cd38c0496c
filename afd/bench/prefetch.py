"""FFN layer time with and without weight prefetch at decode-sized batches (one process, one core).

The FFN node's loop is replayed: for every layer, the prefetch schedule runs (standing in for the wait
for that layer's inputs), then the layer computes. Many layers make the weights far larger than the
last-level cache, as on a real FFN node, so every layer starts cold unless something warmed it.
Reported per layer: compute time without prefetch, compute time after prefetch (what the node sees
when the communication gap hides the prefetch), and the prefetch's own time.
"""

from __future__ import annotations

import statistics
import time

import torch

BUDGETS_MIB = (4, 16)


def _model(num_layers: int):
    from afd.bench.step import BENCH_CONFIG
    from afd.model.checkpoint import DummyReader, build_ffn_half
    from afd.model.registry import config_from_hf

    cfg = config_from_hf({**BENCH_CONFIG, "num_layers": num_layers})
    return cfg, build_ffn_half(cfg, DummyReader(0), torch.float32, torch.device("cpu"))


def _pass(be, ffn, xs, schedule) -> tuple[list[float], list[float]]:
    compute, hint = [], []
    for layer, x in enumerate(xs):
        t0 = time.perf_counter()
        if schedule is not None:
            schedule(layer)
        t1 = time.perf_counter()
        ffn(be, layer, x)
        compute.append(time.perf_counter() - t1)
        hint.append(t1 - t0)
    return compute, hint


def run_prefetch_bench(tokens=(8, 32), repeats: int = 5, num_layers: int = 8) -> dict:
    from afd.backend import get_backend
    from afd.dataplane.prefetch import PrefetchConfig, PrefetchSchedule

    torch.set_num_threads(1)
    be = get_backend("cpu")
    cfg, ffn = _model(num_layers)
    results = {}
    with torch.inference_mode():
        for T in tokens:
            xs = [torch.randn(T, cfg.hidden_size) for _ in range(num_layers)]
            variants = {"off": None}
            for mib in BUDGETS_MIB:
                variants[f"on {mib} MiB"] = PrefetchSchedule(ffn, be, PrefetchConfig(True, mib << 20))
            samples = {k: ([], []) for k in variants}
            _pass(be, ffn, xs, None)  # warm-up
            for _ in range(repeats):
                for name, sched in variants.items():  # interleaved, so noise hits every variant alike
                    c, h = _pass(be, ffn, xs, sched)
                    samples[name][0].extend(c)
                    samples[name][1].extend(h)
            base = statistics.median(samples["off"][0])
            results[T] = {
                name: {
                    "compute_ms": 1e3 * statistics.median(c),
                    "prefetch_ms": 1e3 * statistics.median(h),
                    "compute_vs_off": statistics.median(c) / base,
                }
                for name, (c, h) in samples.items()
            }
    return results


def format_prefetch(results: dict) -> str:
    lines = [
        "| tokens | variant | layer compute (ms) | prefetch in the gap (ms) | compute vs off |",
        "|---|---|---|---|---|",
    ]
    for T, rows in results.items():
        for name, r in rows.items():
            lines.append(
                f"| {T} | {name} | {r['compute_ms']:.2f} | {r['prefetch_ms']:.2f} | {r['compute_vs_off']:.2f}x |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_prefetch(run_prefetch_bench()))
