"""Section (1) of `afd bench-suite`: one MoE layer on one thread — afd's grouped GEMM over tokens
sorted by expert vs the per-expert loop of HF's LongcatFlashExperts vs every token through every expert."""

from __future__ import annotations

import time

from afd.bench.common import interleaved, median
from afd.bench.step import BENCH_CONFIG


def _log(msg: str) -> None:
    print(f"  .. {msg}", flush=True)


def _moe_layer():
    """Layer 0 of BENCH_CONFIG's FFN half (dummy weights, seed 0) and its experts in HF's layout."""
    import torch

    from afd.backend import get_backend
    from afd.backend.cpu_packed import plain
    from afd.model.checkpoint import DummyReader, build_ffn_half
    from afd.model.longcat_flash.config import LongcatFlashConfig
    from afd.model.longcat_flash.ffn import FFNHalf
    from afd.model.registry import config_from_hf

    cfg = config_from_hf({**BENCH_CONFIG, "num_layers": 1})
    assert isinstance(cfg, LongcatFlashConfig)  # BENCH_CONFIG is LongCat-Flash's, as is HF's layout below
    ffn = build_ffn_half(cfg, DummyReader(0), torch.float32, torch.device("cpu"))
    assert isinstance(ffn, FFNHalf)  # LongCat-Flash's half: its layers are FFNLayer
    layer = ffn.layer(0)  # ffn.layers[0]
    ex = layer.experts
    G, H, I = ex.w13.shape[0], cfg.hidden_size, cfg.expert_ffn_hidden_size
    # transformers up to 5.24 allocated gate/up rows for the identity experts too (never used).
    zeros = torch.zeros(cfg.num_experts_total - G, 2 * I, H)
    w13, w2 = plain(ex.w13), plain(ex.w2)  # as loaded: perhaps packed (afd.backend.cpu_packed)
    hf = {
        "gate_up": torch.cat([w13.transpose(1, 2), zeros]).contiguous(),
        "down": w2.transpose(1, 2).contiguous(),
        "w13": w13,
        "w2": w2,
        "n_routed": cfg.n_routed_experts,
    }
    return cfg, layer, hf, get_backend("cpu")


def naive_experts(x, weights, ids, gate_up, down, n_routed: int):
    """HF transformers' eager LongCat-Flash experts: one_hot mask, then per hit expert torch.where ->
    gather -> two linears -> index_add (identity experts add w * x, in expert order)."""
    import torch
    import torch.nn.functional as F

    out = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=gate_up.shape[0]).permute(2, 1, 0)  # [E, K, T]
    for e_t in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
        e = int(e_t.item())
        sel, tok = torch.where(mask[e].squeeze(0))
        cur = x[tok]
        if e >= n_routed:
            h = cur
        else:
            gate, up = F.linear(cur, gate_up[e]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, down[e])
        out.index_add_(0, tok, (h * weights[tok, sel, None]).to(x.dtype))
    return out


def dense_experts(x, weights, ids, w13, w2, num_experts: int):
    """Every token through every routed expert (batched GEMMs), combined with the routing weights;
    num_experts counts the identity experts too."""
    import torch
    import torch.nn.functional as F

    G = w13.shape[0]
    full = torch.zeros(x.shape[0], num_experts).scatter_(1, ids, weights)  # [T, E]: 0 where not routed
    gate, up = torch.matmul(x, w13).chunk(2, dim=-1)  # [G, T, I]
    y = torch.bmm(F.silu(gate) * up, w2)  # [G, T, H]
    out = (y * full[:, :G].t()[:, :, None]).sum(0)
    return out + x * full[:, G:].sum(dim=1, keepdim=True)


def _gemm_inputs(layer, T: int, H: int, seed: int):
    import torch

    x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        weights, ids = layer.router(x)
    return x, weights, ids


def _gemm_variants(layer, hf, backend, x, weights, ids) -> dict:
    ex = layer.experts
    return {
        "grouped": lambda: ex(backend, x, weights, ids),
        "naive": lambda: naive_experts(x, weights, ids, hf["gate_up"], hf["down"], hf["n_routed"]),
        "dense": lambda: dense_experts(x, weights, ids, hf["w13"], hf["w2"], hf["gate_up"].shape[0]),
    }


def _time_calls(fn, calls: int) -> float:
    """Median seconds per call (after one warm-up call)."""
    fn()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return median(ts)


def _time_variants(variants: dict, repeats: int, calls: int) -> dict[str, list[float]]:
    import torch

    with torch.inference_mode():
        return interleaved(list(variants), repeats, lambda n, r: _time_calls(variants[n], calls))


def check_grouped_vs_naive(T: int, seed: int = 0) -> dict:
    """Runs the three variants once on the same T tokens: whether naive and dense equal grouped."""
    cfg, layer, hf, backend = _moe_layer()
    return _check(_gemm_variants(layer, hf, backend, *_gemm_inputs(layer, T, cfg.hidden_size, seed)))


def _check(variants: dict) -> dict:
    import torch

    with torch.inference_mode():
        outs = {k: f() for k, f in variants.items()}
    ref = outs["grouped"]
    scale = ref.abs().max().item()
    res = {"output_abs_max": scale}
    for k in ("naive", "dense"):
        res[f"grouped_equals_{k}"] = bool(torch.allclose(outs[k], ref, rtol=1e-4, atol=1e-5 * scale))
        res[f"max_abs_diff_{k}"] = (outs[k] - ref).abs().max().item()
    return res


def section_gemm(args) -> dict:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg, layer, hf, backend = _moe_layer()
        calls = 3 if args.quick else 15
        out = {}
        for T in (8, 32, 128):
            x, w, ids = _gemm_inputs(layer, T, cfg.hidden_size, seed=T)
            variants = _gemm_variants(layer, hf, backend, x, w, ids)
            res = _check(variants)
            rounds = _time_variants(variants, args.repeats, calls)
            routed = int((ids < cfg.n_routed_experts).sum())
            out[str(T)] = res | {
                "ms": {k: 1e3 * median(v) for k, v in rounds.items()},
                "rounds_ms": {k: [1e3 * t for t in v] for k, v in rounds.items()},
                "routed_slots": routed,
                "dense_over_routed_work": T * cfg.n_routed_experts / max(1, routed),
            }
            _log(f"gemm T={T}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in out[str(T)]["ms"].items()))
    finally:
        torch.set_num_threads(before)
    return out


def _print_gemm(res: dict) -> None:
    c = BENCH_CONFIG
    print(
        f"\n### Grouped GEMM experts on CPU (1 thread)\n\nOne MoE layer of BENCH_CONFIG: {c['n_routed_experts']} "
        f"routed + {c['zero_expert_num']} identity experts, top-{c['moe_topk']}, hidden {c['hidden_size']}, "
        f"expert intermediate {c['expert_ffn_hidden_size']}, fp32. Median ms per call, interleaved rounds.\n"
    )
    print(
        "| tokens T | afd grouped GEMM | HF-style per-expert loop | dense (all experts) | loop / grouped "
        "| dense / grouped | dense work / routed work | grouped == loop | grouped == dense |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for T, r in res.items():
        ms = r["ms"]
        print(
            f"| {T} | {ms['grouped']:.3f} | {ms['naive']:.3f} | {ms['dense']:.3f} | "
            f"{ms['naive'] / ms['grouped']:.2f}x | {ms['dense'] / ms['grouped']:.2f}x | "
            f"{r['dense_over_routed_work']:.1f}x | {_yes(r['grouped_equals_naive'])} "
            f"(max diff {r['max_abs_diff_naive']:.1e}) | {_yes(r['grouped_equals_dense'])} |"
        )


def _yes(b: bool) -> str:
    return "yes" if b else "**NO**"
