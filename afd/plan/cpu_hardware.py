"""`--hardware cpu`: this CPU's spec, measured rather than looked up. `afd profile` measures it beside the
cost model (afd.plan.profile) and keeps it in afd's cache, where `load_spec("cpu")` finds it; every figure's
source says what measured it, where and when, as the shipped specs cite their datasheets.

What is measured: the matmul rate per dtype with every usable core (torch's GEMM at a size past the caches),
the memory bandwidth of a copy larger than the last-level cache (afd.backend.cpu_spec), the RAM this process
may use (afd.backend.cpu_memory: the cgroup's limit where there is one), the data plane's link between two
processes over loopback (afd.plan.profile_link), and the cost of launching one small op (the per-kernel
overhead of eager execution)."""

from __future__ import annotations

import platform
import statistics
import time
from pathlib import Path

from afd.plan.hardware import CPU_SPEC, cpu_spec_path, parse_spec

GEMM_N = 1024
"""Square matmul size for the compute rate: 8 MiB of bf16 per operand, past most per-core caches."""


def _gemm_flops(dtype, n: int = GEMM_N, repeats: int = 5) -> float:
    """2 n^3 / the fastest of `repeats` matmuls (a shared machine only ever slows a round down). A dtype the
    CPU has no fast kernel for (fp16 without AVX512-FP16 runs at a few GFLOP/s) is measured at the size a
    256 x 256 probe shows it can finish quickly, so the measurement stays within a second or so."""
    import torch

    def rate(size: int, rounds: int) -> float:
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        torch.matmul(a, b)  # warm-up: the kernel's first call picks and packs
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            best = min(best, time.perf_counter() - t0)
        return 2 * size**3 / best

    probe = rate(256, 2)
    return rate(n, repeats) if 2 * n**3 / probe < 0.1 else probe


def _launch_seconds(repeats: int = 2000) -> float:
    import torch

    x = torch.zeros(1)
    for _ in range(100):
        x.add_(1)
    t0 = time.perf_counter()
    for _ in range(repeats):
        x.add_(1)
    return (time.perf_counter() - t0) / repeats


def measure(link=None) -> dict:
    """This CPU's spec as the YAML's dict (afd.plan.hardware's schema). `link`: the profile's loopback link
    (afd.plan.costs.Link) when it measured one; else it is measured here."""
    import torch

    from afd.backend.cpu_memory import memory_info
    from afd.backend.cpu_spec import copy_bandwidth
    from afd.cluster.cpus import usable_cpus

    threads = usable_cpus()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bf16, fp16 = _gemm_flops(torch.bfloat16), _gemm_flops(torch.float16)
        fp32 = _gemm_flops(torch.float32)
    finally:
        torch.set_num_threads(before)
    bandwidth = copy_bandwidth()
    _, total = memory_info()
    launch = statistics.median(_launch_seconds() for _ in range(3))
    if link is None:
        from afd.plan.profile_fit import fit_link
        from afd.plan.profile_link import measure_link

        link = fit_link(measure_link())
    host, when = platform.node() or "this host", time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cpu = platform.processor() or platform.machine()
    by = f"measured by afd profile on {host} ({cpu}, {threads} usable CPUs), {when}"
    loop = {
        "fabric": "loopback (gloo between two processes)",
        "bandwidth_gb_s": round(link.bandwidth / 1e9, 3),
        "latency_us": round(link.latency * 1e6, 2),
    }
    return {
        "name": CPU_SPEC,
        "description": f"this CPU ({cpu}), measured: {by}",
        "compute_tflops": {"bf16": round(bf16 / 1e12, 4), "fp16": round(fp16 / 1e12, 4), "fp32": round(fp32 / 1e12, 4)},
        "memory": {"bandwidth_tb_s": round(bandwidth / 1e12, 4), "capacity_gb": round(total / 1e9, 2)},
        "links": {"intra_node": loop, "inter_node": dict(loop)},
        "launch_overhead_us": round(launch * 1e6, 2),
        "sources": {
            "compute_tflops": f"{by}: torch.matmul of {GEMM_N}x{GEMM_N} per dtype on every usable CPU, fastest of 5",
            "memory.bandwidth_tb_s": f"{by}: one thread's copy past the last-level cache (afd.backend.cpu_spec)",
            "memory.capacity_gb": f"{by}: MemTotal within the cgroup's limit (afd.backend.cpu_memory)",
            "links": f"{by}: ping-pong between two processes over loopback (afd.plan.profile_link), fitted",
            "launch_overhead_us": f"{by}: one in-place add on a 1-element tensor, median of 3 x 2000",
        },
    }


def write(spec: dict, path: Path | None = None) -> Path:
    import yaml

    parse_spec(spec, CPU_SPEC)  # what `load_spec("cpu")` will read back: refused here rather than there
    path = path or cpu_spec_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path
