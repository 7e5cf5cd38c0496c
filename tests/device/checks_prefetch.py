"""Check `prefetch`: the FFN layer's time with and without weight prefetch on the device (measured in
`make test-device` as on CPU), by afd/bench/prefetch.py's replay of the FFN node's loop: each layer's inputs
arrive a gap after the node starts waiting, the schedule hints in that gap with its computed budget
(bandwidth x measured gap, within the cache: afd/dataplane/prefetch.py), then the layer computes.

On CUDA prefetch is a no-op (a GPU GEMM streams its weights from HBM at full speed; docs/architecture/
backends.md), so the row skips there; on Ascend it is `npu_prefetch` into L2 of the routed experts' slices.
"""

from __future__ import annotations

from device_common import Target
from device_report import Result

MEASURED = "FFN layer time with the computed prefetch budget vs without, 1 and 3 ms gaps: ratios, budget"


def check_prefetch(target: Target, quick: bool) -> Result:
    name = "FFN prefetch vs none"
    if target.kind == "cuda":
        return Result(name, "skip", "prefetch is a no-op on CUDA (backends.md says why)", measured=MEASURED)
    from afd.bench.prefetch import run_prefetch_bench

    variants = ("off", "computed")
    results = run_prefetch_bench(tokens=(8,), repeats=3 if quick else 7, kind=target.kind, variants=variants)
    spec = results.pop("spec")
    figures: dict = {"bandwidth_GBps": round(spec["bandwidth"] / 1e9, 1), "cache_MiB": spec["cache_bytes"] >> 20}
    for case, rows in results.items():
        r = rows["computed"]
        figures[f"{case} compute_vs_off"] = round(r["compute_vs_off"], 3)
        figures[f"{case} budget_MiB"] = round(r["budget_mib"], 1)
    return Result(name, "pass", f"measured ({spec['source']})", figures)
