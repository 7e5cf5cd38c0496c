"""What `afd bench-quant` (afd.bench.quant) measures besides decode speed: a 1A1F cluster under
`--quantization`, the FFN node's resident memory, and per-GEMM times of each half at one batch.

Memory is read from /proc/<pid>/status (VmRSS: resident now; VmHWM: the peak), in bytes. A torch process
holds a few hundred MB before any weight (the runtime, MKL, oneDNN), which dominates on a small model, so
the FFN half's own share is also measured as RSS after its load minus RSS before it, in one process that
runs the FFN node's load path (FFNNode._load: open_reader, serving_quant, build_ffn_half) and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

from afd.bench.common import median


def rss(pid: int | str = "self") -> dict[str, int]:
    """{"rss", "hwm"}: a process's resident bytes now and at its peak (Linux /proc)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out["rss" if key == "VmRSS" else "hwm"] = int(value.split()[0]) * 1024
    return out


@contextlib.contextmanager
def _quantized_doc(method: str | None):
    """The cluster YAML a LocalCluster writes, with model.quantization set. LocalClusterSpec has no such
    field (afd.engine.llm._cluster_spec drops it, so `afd.LLM(..., quantization=Q, ffn_nodes=1)` serves
    unquantized nodes: reported with the bench); the bench adds it to the YAML the nodes read."""
    import afd.cluster.local as local

    base = local.cluster_doc

    def doc(spec):
        d = base(spec)
        if method is not None:
            d["model"]["quantization"] = method
        return d

    local.cluster_doc = doc
    try:
        yield
    finally:
        local.cluster_doc = base


def start_cluster(path: str, dtype: str, method: str | None, dummy: bool = False, exchange_dtype: str = "same"):
    """A started 1A1F LocalCluster (one thread per node, overlap, one micro-batch) serving `path` in `dtype`
    under `--quantization method`; kept up across jobs until closed."""
    from afd.cluster.local import LocalCluster
    from afd.cluster.local_spec import LocalClusterSpec

    spec = LocalClusterSpec(
        path, 1, 1, dtype=dtype, dummy_weights=dummy, overlap=True, micro_batches=1, exchange_dtype=exchange_dtype
    )
    carried = "quantization" in getattr(LocalClusterSpec, "__dataclass_fields__", {})  # once the spec has it
    if carried:
        spec.quantization = method  # type: ignore[attr-defined]
    cluster = LocalCluster(spec)
    with contextlib.nullcontext() if carried else _quantized_doc(method):
        cluster.start()
    return cluster


def ffn_evidence(cluster) -> str:
    """What the FFN node said of its quantization (the backend's log line), or "none"."""
    for line in cluster.processes.log("ffn0").splitlines():
        if "quantization " in line and "GEMMs on" in line:
            return line.split("quantization ", 1)[1].strip()
    return "none"


# ---- memory: the FFN node's load path in a process of its own ---------------------------------------------


def load_ffn(path: str, dtype: str, method: str | None, dummy: bool) -> dict:
    """RSS before and after loading the FFN half as an FFN node does, and the bytes its tensors hold."""
    import torch

    from afd.backend import get_backend
    from afd.model.checkpoint import build_ffn_half, open_reader, serving_quant
    from afd.model.config import parse_dtype
    from afd.model.experts import Experts
    from afd.model.registry import load_config

    backend = get_backend("cpu")
    cfg = load_config(path)
    torch.ones(1) @ torch.ones(1, 1)  # the GEMM libraries' start-up, before the baseline
    before = rss()
    quant = serving_quant(path, method, backend)
    ffn = build_ffn_half(cfg, open_reader(path, dummy), parse_dtype(dtype), backend.device, quant=quant)
    after = rss()
    experts = [m for m in ffn.modules() if isinstance(m, Experts)]
    tensors = list(ffn.parameters()) + list(ffn.buffers())
    return {
        "rss_before": before["rss"],
        "rss_after": after["rss"],
        "hwm": after["hwm"],
        "half_bytes": sum(t.numel() * t.element_size() for t in tensors),
        "expert_bytes": sum(t.numel() * t.element_size() for e in experts for t in (*e.parameters(), *e.buffers())),
        "expert_dtype": str(experts[0].w13.dtype),
    }


def load_ffn_subprocess(path: str, dtype: str, method: str | None, dummy: bool) -> dict:
    argv = [sys.executable, "-m", "afd.bench.quant_parts", path, dtype, method or "none", "1" if dummy else "0"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def node_memory(path: str, dtype: str, method: str | None, dummy: bool) -> dict:
    """The real FFN node's RSS after load and a one-token job (1A1F), and its evidence line."""
    cluster = start_cluster(path, dtype, method, dummy)
    try:
        cluster.generate([[3, 4, 5, 6]], 2, ignore_eos=True)
        mem = rss(cluster.process("ffn0").pid)
        return {"node_rss": mem["rss"], "node_hwm": mem["hwm"], "ffn_quantization": ffn_evidence(cluster)}
    finally:
        cluster.close()


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
    probes = {}
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
    flat = ids.reshape(-1)
    local = (flat >= experts.lo) & (flat < experts.hi)
    group = torch.where(local, flat - experts.lo, experts.hi - experts.lo)
    order = torch.argsort(group, stable=True)
    sizes = torch.bincount(group, minlength=experts.hi - experts.lo + 1)[:-1]
    xs = m[order // K]
    inter = F.silu(experts._gemm(backend, xs, "w13", sizes).chunk(2, dim=-1)[0])
    probes[f"experts w13 grouped [{2 * experts.inter}x{experts.hidden}], {int(sizes.sum())} rows"] = lambda: (
        experts._gemm(backend, xs, "w13", sizes)
    )
    probes[f"experts w2 grouped [{experts.hidden}x{experts.inter}]"] = lambda: experts._gemm(
        backend, inter, "w2", sizes
    )
    probes["FFN half (all MoE layers)"] = lambda: [llm.ffn(backend, i, m) for i in cfg.moe_layers]
    return probes


if __name__ == "__main__":  # python -m afd.bench.quant_parts PATH DTYPE METHOD|none DUMMY(0|1)
    p, dt, q, d = sys.argv[1:5]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps(load_ffn(p, dt, None if q == "none" else q, d == "1")))
