"""Check `gemm`: backend.grouped_matmul vs a per-expert torch.mm loop, bf16 and fp32: error and median time."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from device_common import Target, announce, guarded
from device_env import dtype_supported
from device_report import Result

GEMM_TOL = {"float32": 1e-4, "bfloat16": 2e-2}  # max |grouped - loop| / max |loop|
MEASURED = "backend.grouped_matmul vs a torch.mm loop per expert: max rel error, median ms of each"


def moe_group_sizes(groups: int, rows: int, empty: int, seed: int = 0) -> list[int]:
    """Skewed per-expert row counts, as a router makes them, with `empty` experts given no rows."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.randn(groups, generator=g).exp()
    probs[torch.randperm(groups, generator=g)[:empty]] = 0
    return torch.bincount(torch.multinomial(probs, rows, replacement=True, generator=g), minlength=groups).tolist()


def gemm_cases(quick: bool) -> list[tuple[str, list[int], int, int]]:
    """(label, group sizes, K, N). The MoE shapes are Qwen3-30B-A3B's experts (hidden 2048, expert 768):
    [gate|up] is K=2048 -> N=1536, down K=768 -> N=2048, 4096 token-slots over 32 experts."""
    if quick:
        return [
            ("G=1", [64], 128, 256),
            ("empty groups", [0, 30, 0, 0, 51, 17, 19, 0], 128, 256),
            ("MoE", moe_group_sizes(8, 256, 2), 256, 192),
            ("unaligned", [5, 0, 9, 2], 36, 18),
        ]
    moe = moe_group_sizes(32, 4096, 4)
    return [
        ("G=1", [512], 1024, 2048),
        ("empty groups", [0, 300, 0, 0, 512, 17, 195, 0], 1024, 2048),
        ("MoE gate_up", moe, 2048, 1536),
        ("MoE down", moe, 768, 2048),
        ("unaligned", [5, 0, 9, 2], 36, 18),
    ]  # K, N not multiples of 8: CUDA's fallback path


def loop_matmul(x: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The baseline: one torch.mm per non-empty group, sizes already on the host (its best case)."""
    out = x.new_empty(x.shape[0], w.shape[-1])
    start = 0
    for g, n in enumerate(sizes):
        if n:
            torch.mm(x[start : start + n], w[g], out=out[start : start + n])
            start += n
    return out


def time_interleaved(fns: dict[str, Callable], sync: Callable, repeats: int, calls: int) -> dict[str, float]:
    """Median ms per call of each fn over `repeats` rounds, the fns interleaved within each round so that
    clock and thermal drift hit them alike; the device is synchronized around each timed batch of calls."""
    from afd.bench.common import interleaved, median

    for f in fns.values():  # warm-up: kernel selection, allocator
        f()
    sync()

    def timed(name: str, _round: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fns[name]()
        sync()
        return (time.perf_counter() - t0) / calls

    return {n: round(median(ts) * 1e3, 4) for n, ts in interleaved(list(fns), repeats, timed).items()}


def gemm_case(backend, dtype: str, label: str, sizes: list[int], K: int, N: int, quick: bool) -> Result:
    name = f"grouped GEMM {dtype} {label}"
    dev, dt_ = backend.device, getattr(torch, dtype)
    g = torch.Generator().manual_seed(len(sizes) * 1000 + K)
    x = torch.randn(sum(sizes), K, generator=g).to(dev, dt_)
    w = (torch.randn(len(sizes), K, N, generator=g) / math.sqrt(K)).to(dev, dt_)
    group_sizes = torch.tensor(sizes, dtype=torch.int64, device=dev)  # the interface: [G] int64 on the device
    with torch.inference_mode():
        got = backend.grouped_matmul(x, w, group_sizes)
        ref = loop_matmul(x, w, sizes)
        backend.synchronize()
        err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()
        ms = time_interleaved(
            {"grouped": lambda: backend.grouped_matmul(x, w, group_sizes), "loop": lambda: loop_matmul(x, w, sizes)},
            backend.synchronize,
            repeats=5 if quick else 15,
            calls=3 if quick else 10,
        )
    figures = {
        "G": len(sizes),
        "T": sum(sizes),
        "K": K,
        "N": N,
        "empty_groups": sizes.count(0),
        "rel_err": err,
        "tol": GEMM_TOL[dtype],
        "grouped_ms": ms["grouped"],
        "loop_ms": ms["loop"],
        "speedup": round(ms["loop"] / ms["grouped"], 2) if ms["grouped"] else None,
    }
    if tuple(got.shape) != tuple(ref.shape) or got.dtype != ref.dtype:
        return Result(
            name, "fail", f"output {tuple(got.shape)} {got.dtype}, expected {tuple(ref.shape)} {ref.dtype}", figures
        )
    if not err <= GEMM_TOL[dtype]:  # `not <=`: a NaN error fails too
        return Result(name, "fail", f"rel err {err:.3g} > {GEMM_TOL[dtype]}", figures)
    return Result(name, "pass", f"within {GEMM_TOL[dtype]}; {figures['speedup']}x the loop", figures)


def check_gemm(target: Target, quick: bool) -> list[Result]:
    from afd.backend import get_backend

    backend = get_backend(target.kind)
    out = []
    for dtype in ("bfloat16", "float32"):
        ok, why = dtype_supported(target, dtype)
        if not ok:
            out.append(Result(f"grouped GEMM {dtype}", "skip", why))
            continue
        for label, sizes, K, N in gemm_cases(quick):
            out.append(
                guarded(
                    lambda: gemm_case(backend, dtype, label, sizes, K, N, quick),  # noqa: B023
                    f"grouped GEMM {dtype} {label}",
                    MEASURED,
                )
            )
            announce(out[-1])
    return out
