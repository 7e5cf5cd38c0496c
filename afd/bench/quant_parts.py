"""What `afd bench-quant` (afd.bench.quant) measures besides colocated decode: 1A1F clusters under
`--quantization`, per-GEMM times of each half at one batch, and the bytes on the wire per
layout.exchange_dtype. (The FFN node's memory: afd.bench.quant_mem.)"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from afd.bench.common import median, synthetic_prompts


def start_cluster(path: str, dtype: str, method: str | None, dummy: bool = False, exchange_dtype: str = "same"):
    """A started 1A1F LocalCluster (one thread per node, overlap, one micro-batch) serving `path` in `dtype`
    under `--quantization method`; kept up across jobs until closed."""
    from afd.cluster.local import LocalCluster
    from afd.cluster.local_config import local_job

    job = local_job(
        path,
        1,
        1,
        dtype=dtype,
        quantization=method,
        dummy_weights=dummy,
        overlap=True,
        micro_batches=1,
        exchange_dtype=exchange_dtype,
    )
    cluster = LocalCluster(job)
    cluster.start()
    return cluster


def tok_s(steps: list[dict], skip: int) -> dict:
    """Decode tok/s, mean step and the share of it the attention side waited on the FFN node (0 colocated),
    over the decode steps past the prefill and `skip` warm-up steps."""
    d = steps[1 + skip :]
    seconds = sum(s["seconds"] for s in d)
    wait = sum(s["ffn_wait"] for s in d) / seconds
    return {"tok_s": sum(s["tokens"] for s in d) / seconds, "step_ms": 1e3 * seconds / len(d), "ffn_wait": wait}


def ffn_evidence(cluster) -> str:
    """What the FFN node said of its quantization (the backend's log line), or "none"."""
    for line in cluster.processes.log("ffn0").splitlines():
        if "quantization " in line and "GEMMs on" in line:
            return line.split("quantization ", 1)[1].strip()
    return "none"


# ---- per-GEMM times at one batch ------------------------------------------------------------------------------


def time_call(fn, calls: int = 30) -> float:
    """Median seconds of `calls` calls, one torch thread, after two warm-up calls."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            fn(), fn()
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return median(times)
    finally:
        torch.set_num_threads(before)


def gemm_probes(llm, tokens: int, seed: int = 0) -> dict:
    """name -> a no-argument call of one GEMM at `tokens` rows, in llm's dtype: each distinct linear of the
    attention half's first layer and the head (nn.Linear or QuantLinear as the mode made them), and the first
    MoE layer's grouped GEMMs (w13 then w2) over a router's choice for random tokens; plus whole halves:
    "FFN half (all MoE layers)"."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from afd.model.quant_layers import QuantLinear

    g = torch.Generator().manual_seed(seed)
    dtype, backend, cfg = llm.dtype, llm.backend, llm.cfg
    probes: dict[str, Callable[..., Any]] = {}
    for name, mod in llm.attn.named_modules():
        if isinstance(mod, (nn.Linear, QuantLinear)) and (name.startswith("layers.0.") or name == "lm_head"):
            x = torch.randn(tokens, mod.in_features, generator=g).to(dtype)
            probes[f"{name} [{mod.out_features}x{mod.in_features}]"] = lambda mod=mod, x=x: mod(x)
    m = torch.randn(tokens, cfg.hidden_size, generator=g).to(dtype)
    layer = cfg.moe_layers[0]
    moe = llm.ffn.layer(layer)
    experts = moe.experts
    with torch.inference_mode():
        llm.ffn(backend, layer, m)  # the router's choice for these tokens: experts.last_ids
    ids = experts.last_ids
    T, K = ids.shape
    group = experts._group(ids.reshape(-1))
    order = torch.argsort(group, stable=True)
    sizes = torch.bincount(group, minlength=len(experts.held) + 1)[:-1]
    xs = m[order // K]
    inter = F.silu(experts._gemm(backend, xs, "w13", sizes).chunk(2, dim=-1)[0])
    probes[f"experts w13 grouped [{2 * experts.inter}x{experts.hidden}], {int(sizes.sum())} rows"] = lambda: (
        experts._gemm(backend, xs, "w13", sizes)
    )
    probes[f"experts w2 grouped [{experts.hidden}x{experts.inter}]"] = lambda: experts._gemm(
        backend, inter, "w2", sizes
    )
    # one group's call, at the layer's mean rows per routed expert: what the grouped GEMM repeats per expert
    r = max(1, round(int(sizes.sum()) / max(1, int((sizes > 0).sum()))))
    one = torch.zeros_like(sizes)
    one[0] = r
    probes[f"one expert's w13 call, {r} rows"] = lambda: experts._gemm(backend, xs[:r], "w13", one)
    if experts.w13.dtype == torch.int8:  # its parts (afd.backend.cpu_quant.int8_matmul)
        from afd.quant.formats import quantize_rows_int8

        xq, _ = quantize_rows_int8(xs[:r])
        probes[f"  of which per-token int8 quantization of {r} rows"] = lambda: quantize_rows_int8(xs[:r])
        probes["  of which torch._int_mm alone"] = lambda: torch._int_mm(xq, experts.w13[0].t())
    probes["FFN half (all MoE layers)"] = lambda: [llm.ffn(backend, i, m) for i in cfg.moe_layers]
    return probes


def section_wire(args, path: str, dummy: bool, modes: dict) -> dict:
    """Bytes per step each layout.exchange_dtype puts on the wire: counted by the attention node (a2f_bytes,
    the count afd_exchange_bytes_total{direction="to_ffn"} exports) against the formula."""
    from afd.dataplane.protocol import exchange_bytes
    from afd.model.registry import load_config

    cfg = load_config(path)
    dtype, method = modes[args.wire_mode]
    b = args.gemm_tokens
    prompts = synthetic_prompts(b, args.prompt_len, cfg.vocab_size)
    out = {}
    for ex in ("same", "fp8", "int8"):
        print(f"  .. wire {ex}", flush=True)
        cluster = start_cluster(path, dtype, method, dummy, exchange_dtype=ex)
        try:
            _, reports = cluster.generate(prompts, args.steps + args.warmup_steps + 1, ignore_eos=True)
        finally:
            cluster.close()
        steps, L = reports[0]["steps"], len(cfg.moe_layers)
        formula = sum(exchange_bytes(s["tokens"], cfg.hidden_size, dtype, ex)["to_ffn"] for s in steps) * L
        per_step = {k: v * L for k, v in exchange_bytes(b, cfg.hidden_size, dtype, ex).items()}
        per_step_bf16 = {k: v * L for k, v in exchange_bytes(b, cfg.hidden_size, "bfloat16", ex).items()}
        out[ex] = {"counted_to_ffn": reports[0]["a2f_bytes"], "formula_to_ffn": formula, "per_step": per_step,
                   "per_step_bf16_model": per_step_bf16} | tok_s(steps, args.warmup_steps)  # fmt: skip
    return {"mode": args.wire_mode, "dtype": dtype, "batch": b, "moe_layers": L, "results": out}
