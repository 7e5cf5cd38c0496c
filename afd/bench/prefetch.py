"""FFN layer time with and without weight prefetch at decode-sized batches (one process, one thread).

The FFN node's loop is replayed layer by layer: the inputs of a layer "arrive" `gap` after the node
starts waiting for them (a sleep, as a blocking gloo wait is); the prefetch schedule hints in that gap,
as FFNServer calls it, and is told the measured gap the same way (the wait, or 0 when the hint outlasted
it); then the layer computes. Many layers make the weights far larger than one core's share of the
last-level cache, so every layer starts cold unless something warmed it. Each step's inputs are the
same tokens with fresh noise, so that routing repeats partly from step to step, as in decode.

Reported per variant: layer compute (router + experts), the hint's own time, the layer's time from the
start of its wait to the end of its compute (what the attention node waits for), and the computed budget.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from afd.dataplane.prefetch import PrefetchConfig, PrefetchSchedule

GAPS_MS = (1.0, 3.0)
NOISE = 0.5
"""Step-to-step change of a layer's input, relative to the input (std): decode's next token of the
same sequences routes partly like the last one."""
VARIANTS = ("off", "computed", "computed + after router", "fixed 8 MiB", "old: first 8 MiB")
"""old: the rule before the computed budget: a fixed 8 MiB from the start of the stacked weights (the
router, then expert 0's rows on), whatever the router chose."""


def _model(num_layers: int, device: torch.device, dtype: torch.dtype):
    from afd.bench.step import BENCH_CONFIG
    from afd.model.checkpoint import DummyReader, build_ffn_half
    from afd.model.registry import config_from_hf

    cfg = config_from_hf({**BENCH_CONFIG, "num_layers": num_layers})
    return cfg, build_ffn_half(cfg, DummyReader(0), dtype, device)


def _schedules(ffn, be, spec, num_layers: int, variants) -> tuple[dict, dict]:
    """The schedules, and each one's after-router hooks: they share one model, so each sets its hook (or
    none) on a layer just before running it."""
    made = {
        "computed": PrefetchConfig(True),
        "computed + after router": PrefetchConfig(True, after_router=True),
        "fixed 8 MiB": PrefetchConfig(True, budget_bytes=8 << 20),
    }
    made["old: first 8 MiB"] = made["fixed 8 MiB"]
    scheds, hooks = {}, {}
    for name, cfg in made.items():
        if name not in variants:
            continue
        scheds[name] = (_FirstBytes if name.startswith("old") else PrefetchSchedule)(ffn, be, cfg, spec)
        hooks[name] = {i: ffn.layer(i).experts.before_gemm for i in range(num_layers)}
        _unhook(ffn, num_layers)
    return scheds, hooks


class _FirstBytes(PrefetchSchedule):
    """The old rule: every expert in order, so the budget covers the first bytes of w13 (then w2)."""

    def after_compute(self, layer: int) -> None:
        experts: Any = self.ffn.layer(layer).experts  # afd.model.experts.Experts (FFNHalf.layer's MoE)
        self.known[layer] = list(range(experts.w13.shape[0]))


def _step(be, ffn, xs, sched, hooks: dict, gap: float, out: dict) -> None:
    for layer, x in enumerate(xs):
        t0 = time.perf_counter()
        ffn.layer(layer).experts.before_gemm = hooks.get(layer)
        if sched is not None:
            sched(layer)
        be.synchronize()  # a device's hints are queued: time them done (this is a benchmark, not the node)
        t1 = time.perf_counter()
        left = t0 + gap - t1
        if left > 0:
            time.sleep(left)  # the rest of the wait for the layer's inputs
        t2 = time.perf_counter()
        if sched is not None:
            sched.observe_gap(layer, t2 - t0 if left > 0 else 0.0)
        ffn(be, layer, x)
        be.synchronize()
        t3 = time.perf_counter()
        if sched is not None:
            sched.after_compute(layer)
            out["budget"].append(sched.last_budget[layer])
        out["compute"].append(t3 - t2)
        out["hint"].append(t1 - t0)
        out["layer"].append(t3 - t0)


def run_prefetch_bench(
    tokens=(8, 32),
    repeats: int = 5,
    num_layers: int = 8,
    gaps_ms=GAPS_MS,
    kind: str = "cpu",
    dtype: torch.dtype = torch.float32,
    variants: tuple[str, ...] = VARIANTS,
) -> dict:
    """kind: the backend (`make test-device` runs it on the NPU: tests/device/checks_prefetch.py); variants:
    which of VARIANTS, "off" first."""
    from afd.backend import get_backend

    torch.set_num_threads(1)
    be = get_backend(kind)
    spec = be.prefetch_spec()
    assert spec is not None  # CPU and NPU report one; callers skip CUDA, where prefetch is a no-op
    cfg, ffn = _model(num_layers, be.device, dtype)
    scheds, hooks = _schedules(ffn, be, spec, num_layers, variants)
    results: dict = {"spec": {"bandwidth": spec.bandwidth, "cache_bytes": spec.cache_bytes, "source": spec.source}}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for T in tokens:
            base = [torch.randn(T, cfg.hidden_size, generator=gen) for _ in range(num_layers)]

            def inputs(base=base):
                return [(b + NOISE * torch.randn(b.shape, generator=gen)).to(be.device, dtype) for b in base]

            for gap_ms in gaps_ms:
                gap = gap_ms / 1e3
                samples: dict[str, dict[str, list[float]]] = {
                    v: {"compute": [], "hint": [], "layer": [], "budget": []} for v in variants
                }
                for v in variants:  # warm-up: a measured gap and a first guess for every schedule
                    for _ in range(3):
                        _step(be, ffn, inputs(), scheds.get(v), hooks.get(v, {}), gap, {k: [] for k in samples[v]})
                for r in range(repeats):
                    order = variants[r % len(variants) :] + variants[: r % len(variants)]  # rotates per round
                    xs = inputs()  # one step's inputs, the same for every variant of the round
                    for v in order:
                        _step(be, ffn, xs, scheds.get(v), hooks.get(v, {}), gap, samples[v])
                _unhook(ffn, num_layers)
                results[f"T={T} gap={gap_ms:g}ms"] = _summary(samples)
    return results


def _unhook(ffn, num_layers: int) -> None:
    for i in range(num_layers):
        ffn.layer(i).experts.before_gemm = None


def _summary(samples: dict) -> dict:
    med = {v: {k: statistics.median(x) if x else 0.0 for k, x in s.items()} for v, s in samples.items()}
    off = med["off"]
    return {
        v: {
            "compute_ms": 1e3 * m["compute"],
            "hint_ms": 1e3 * m["hint"],
            "layer_ms": 1e3 * m["layer"],
            "budget_mib": m["budget"] / (1 << 20),
            "compute_vs_off": m["compute"] / off["compute"],
            "layer_vs_off": m["layer"] / off["layer"],
        }
        for v, m in med.items()
    }


def format_prefetch(results: dict) -> str:
    spec = results.get("spec", {})
    lines = []
    if spec:
        lines.append(
            f"Budget per layer = min(bandwidth x measured gap, cache) with bandwidth "
            f"{spec['bandwidth'] / 1e9:.1f} GB/s and cache {spec['cache_bytes'] >> 20} MiB ({spec['source']}).\n"
        )
    lines += [
        "| case | variant | budget (MiB) | hint (ms) | layer compute (ms) | wait + compute (ms) "
        "| compute vs off | wait + compute vs off |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case, rows in results.items():
        if case == "spec":
            continue
        for name, r in rows.items():
            lines.append(
                f"| {case} | {name} | {r['budget_mib']:.1f} | {r['hint_ms']:.2f} | {r['compute_ms']:.2f} | "
                f"{r['layer_ms']:.2f} | {r['compute_vs_off']:.3f}x | {r['layer_vs_off']:.3f}x |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_prefetch(run_prefetch_bench()))
