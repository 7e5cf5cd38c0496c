"""`afd bench-quant`'s memory section: the FFN node's resident memory per mode.

Memory is read from /proc/<pid>/status (VmRSS: resident now; VmHWM: the peak), in bytes. A torch process
holds a few hundred MB before any weight (the runtime, MKL, oneDNN), which dominates on a small model, so
it is measured three ways: the real FFN node's RSS after load (1A1F, a one-token job); RSS after the FFN
node's load path (FFNNode._load: open_reader, serving_quant, build_ffn_half) minus RSS before it, in one
process that does nothing else; and the bytes the loaded experts' tensors hold. Each on the bench model and
on MEMORY_CONFIG, whose experts dwarf the runtime.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from afd.bench.common import write_config
from afd.bench.step import BENCH_CONFIG

MEMORY_CONFIG = {**BENCH_CONFIG, "hidden_size": 1024, "num_layers": 4, "n_routed_experts": 64,
                 "expert_ffn_hidden_size": 1024}  # fmt: skip
"""BENCH_CONFIG scaled until its experts (3.2 GB in fp32) dwarf a torch process's own few hundred MB."""


def rss(pid: int | str = "self") -> dict[str, int]:
    """{"rss", "hwm"}: a process's resident bytes now and at its peak (Linux /proc)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out["rss" if key == "VmRSS" else "hwm"] = int(value.split()[0]) * 1024
    return out


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
    argv = [sys.executable, "-m", "afd.bench.quant_mem", path, dtype, method or "none", "1" if dummy else "0"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def node_memory(path: str, dtype: str, method: str | None, dummy: bool) -> dict:
    """The real FFN node's RSS after load and a one-token job (1A1F), and its evidence line."""
    from afd.bench.quant_parts import ffn_evidence, start_cluster

    cluster = start_cluster(path, dtype, method, dummy)
    try:
        cluster.generate([[3, 4, 5, 6]], 2, ignore_eos=True)
        mem = rss(cluster.process("ffn0").pid)
        return {"node_rss": mem["rss"], "node_hwm": mem["hwm"], "ffn_quantization": ffn_evidence(cluster)}
    finally:
        cluster.close()


def section_memory(args, path: str, dummy: bool, state: dict, tmp: str, modes: dict) -> dict:
    """Per mode: the bench model's and MEMORY_CONFIG's (dummy weights) FFN memory, three ways."""
    big = args.memory_model or write_config(os.path.join(tmp, "memory-model"), MEMORY_CONFIG)
    out = {}
    for m in state["modes"]:
        dtype, method = modes[m]
        print(f"  .. memory {m}", flush=True)
        row = {"bench": load_ffn_subprocess(path, dtype, method, dummy)}
        if m in state["node_rss"]:
            row["bench"] |= state["node_rss"][m]
        row["large"] = load_ffn_subprocess(big, dtype, method, True)
        row["large"] |= node_memory(big, dtype, method, True)
        out[m] = row
    with open(os.path.join(big, "config.json")) as f:
        return {"results": out, "large_model": json.load(f)}


if __name__ == "__main__":  # python -m afd.bench.quant_mem PATH DTYPE METHOD|none DUMMY(0|1)
    p, dt, q, d = sys.argv[1:5]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps(load_ffn(p, dt, None if q == "none" else q, d == "1")))
