"""Check `ffngraph`: the FFN half's layers as the backend's graphs (afd/model/ffn_graph.py: CUDA graphs,
torchair), one per (layer, token bucket), built at warm-up, against the same layers eager on the CPU in fp32.

Seeded random weights of the demo config (DummyReader: the same values on both sides), every MoE layer, token
counts inside buckets (padded), at a bucket's size, and above the largest (eager): outputs within a
tolerance, and in fp32 the per-expert counts the metrics read equal to the CPU's (padded rows not counted).
Each input is run twice with different values, so a graph's replay must take its new inputs.
"""

from __future__ import annotations

import torch
from device_common import Target, median_ms
from device_env import dtype_supported
from device_report import Result

MEASURED = "FFN layers as device graphs per token bucket vs CPU fp32 eager: max rel error, counts, median ms"
BUCKETS = (1, 2, 4, 8, 16)
TOKENS = (1, 3, 8, 13, 24)  # 24: above the largest bucket, eager
TIMED = 13  # tokens of the timed calls: padded to 16
TOL = {"float32": 1e-4, "bfloat16": 3e-2}  # max |graph - cpu| / max |cpu|, per layer and T


def check_ffn_graph(target: Target, dtype: str) -> Result:
    name = f"FFN graphs {dtype} vs CPU fp32"
    if target.kind == "cpu":
        why = "CPU keeps the FFN half eager: its grouped GEMM reads the group sizes on the host (no graph)"
        return Result(name, "skip", why, measured=MEASURED)
    ok, why = dtype_supported(target, dtype)
    if not ok:
        return Result(name, "skip", why, measured=MEASURED)
    from afd.backend import get_backend
    from afd.model.checkpoint import DummyReader, build_ffn_half
    from afd.model.demo_config import DEMO_CONFIG
    from afd.model.ffn_graph import FFNGraph, wrap
    from afd.model.registry import config_from_hf

    cfg = config_from_hf(DEMO_CONFIG)
    backend, cpu = get_backend(target.kind), get_backend("cpu")
    ref = build_ffn_half(cfg, DummyReader(0), torch.float32, cpu.device)
    dev = build_ffn_half(cfg, DummyReader(0), getattr(torch, dtype), backend.device)
    graph = wrap(dev, backend, "compile", BUCKETS, 1)  # the node's way: buckets as given, with one peer
    if not isinstance(graph, FFNGraph):  # e.g. CUDA in fp32, or before Hopper: torch._grouped_mm's fallback
        why = f"the FFN half stays eager on {target.kind} in {dtype}: its grouped GEMM reads group sizes on the host"
        return Result(name, "skip", why, measured=MEASURED)
    layers = list(cfg.moe_layers)
    if graph.warmup_graphs != len(layers) * len(BUCKETS):
        why = f"{graph.warmup_graphs} graphs built of {len(layers) * len(BUCKETS)} (see the log for why)"
        return Result(name, "fail", why, measured=MEASURED)
    g = torch.Generator().manual_seed(0)
    worst, bad_counts = 0.0, []
    with torch.inference_mode():
        for layer in layers:
            for T in TOKENS:
                for _ in range(2):  # a replay with new values
                    x = torch.randn(T, cfg.hidden_size, generator=g)
                    got = graph(backend, layer, x.to(backend.device, getattr(torch, dtype))).float().cpu()
                    want = ref(cpu, layer, x)
                    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
                    worst = err if not err <= worst else worst  # a NaN stays
                    counts = graph._experts(layer).last_counts.cpu()
                    if dtype == "float32" and not torch.equal(counts, ref.layer(layer).experts.last_counts):
                        bad_counts.append((layer, T))
        passes = dict(graph.passes)
        xt = torch.randn(TIMED, cfg.hidden_size, generator=g).to(backend.device, getattr(torch, dtype))
        ms = median_ms(backend, lambda: graph(backend, layers[0], xt))
        dev_eager = median_ms(backend, lambda: dev(backend, layers[0], xt))
    figures = {
        "graphs": graph.warmup_graphs,
        "warmup_s": round(graph.warmup_seconds, 2),
        "passes": passes,
        "rel_err": worst,
        "tol": TOL[dtype],
        f"graph_ms_T{TIMED}": ms,
        f"eager_ms_T{TIMED}": dev_eager,
    }
    if not worst <= TOL[dtype]:
        return Result(name, "fail", f"rel err {worst:.3g} > {TOL[dtype]}", figures)
    if bad_counts:
        return Result(name, "fail", f"per-expert counts differ from the CPU's at (layer, T) {bad_counts}", figures)
    above = sum(BUCKETS[-1] < T for T in TOKENS)
    want = {"graph": 2 * len(layers) * (len(TOKENS) - above), "eager": 2 * len(layers) * above}
    if passes != want:
        return Result(name, "fail", f"passes by mode {passes}, expected {want}", figures)
    return Result(name, "pass", f"within {TOL[dtype]}; {len(layers)} layers x {len(BUCKETS)} buckets", figures)
