"""Metric math of `afd bench`: pure functions over per-request records.

Definitions and JSON key names follow `vllm bench serve` (see CONVENTIONS.md, "Benchmark client"), so that
result files of both tools can be compared by the same scripts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

METRIC_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds."""

    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    start: float = 0.0  # since the benchmark started: places the request's tokens on the time axis
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def tpot(r: RequestResult) -> float | None:
    """(latency − TTFT) / (output tokens − 1); None for one-token replies, which have no decode time."""
    if r.output_tokens < 2:
        return None
    return (r.latency - r.ttft) / (r.output_tokens - 1)


def metric_values(results: list[RequestResult], metric: str) -> list[float]:
    """The samples of one metric in seconds, over successful requests only."""
    ok = [r for r in results if r.success]
    if metric == "ttft":
        return [r.ttft for r in ok]
    if metric == "tpot":
        return [t for r in ok if (t := tpot(r)) is not None]
    if metric == "itl":
        return [gap for r in ok for gap in r.itl]
    if metric == "e2el":
        return [r.latency for r in ok]
    raise ValueError(f"unknown metric {metric!r}; choose from {', '.join(METRIC_TITLES)}")


def percentile_label(p: float) -> str:
    """99 -> '99', 99.9 -> '99.9': the spelling inside vllm's `p<P>_<m>_ms` keys."""
    return str(int(p)) if float(p).is_integer() else str(p)


def metric_stats(values_s: list[float], metric: str, percentiles: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1000.0
    if ms.size == 0:
        # Report zeros rather than NaN so that the JSON stays valid and plots do not break.
        ms = np.zeros(1)
    out = {
        f"mean_{metric}_ms": float(ms.mean()),
        f"median_{metric}_ms": float(np.median(ms)),
        f"std_{metric}_ms": float(ms.std()),
    }
    for p in percentiles:
        out[f"p{percentile_label(p)}_{metric}_ms"] = float(np.percentile(ms, p))
    return out


def peak_output_throughput(results: list[RequestResult]) -> float:
    """Most output tokens received within one 1-second bin of the run.

    Each content chunk counts as one token at the moment it arrived, the only per-token timing a
    streaming client has.
    """
    times = []
    for r in results:
        if not r.success:
            continue
        t = r.start + r.ttft
        times.append(t)
        for gap in r.itl:
            t += gap
            times.append(t)
    if not times:
        return 0.0
    return float(np.bincount(np.floor(np.asarray(times)).astype(int)).max())


def summarize(results: list[RequestResult], duration: float, metrics: list[str], percentiles: list[float]) -> dict:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    d = max(duration, 1e-9)
    out = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / d,
        "output_throughput": total_out / d,
        "total_token_throughput": (total_in + total_out) / d,
        "max_output_tokens_per_s": peak_output_throughput(results),
    }
    for m in metrics:
        out.update(metric_stats(metric_values(results, m), m, percentiles))
    return out


def distinct_errors(results: list[RequestResult], limit: int = 5) -> list[tuple[str, int]]:
    """The first `limit` distinct error texts, in order of first appearance, with their counts."""
    counts: dict[str, int] = {}
    for r in results:
        if not r.success:
            counts[r.error] = counts.get(r.error, 0) + 1
    return list(counts.items())[:limit]


def _row(label: str, value) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40} {text:<10}"


def format_report(s: dict, metrics: list[str], percentiles: list[float], max_concurrency: int | None) -> str:
    lines = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
        _row("Successful requests:", s["completed"]),
        _row("Failed requests:", s["failed"]),
    ]
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    lines += [
        _row("Benchmark duration (s):", float(s["duration"])),
        _row("Total input tokens:", s["total_input_tokens"]),
        _row("Total generated tokens:", s["total_output_tokens"]),
        _row("Request throughput (req/s):", float(s["request_throughput"])),
        _row("Output token throughput (tok/s):", float(s["output_throughput"])),
        _row("Peak output token throughput (tok/s):", float(s["max_output_tokens_per_s"])),
        _row("Total token throughput (tok/s):", float(s["total_token_throughput"])),
    ]
    for m in metrics:
        name = m.upper()
        lines.append("{s:{c}^{n}}".format(s=METRIC_TITLES[m], n=50, c="-"))
        lines.append(_row(f"Mean {name} (ms):", s[f"mean_{m}_ms"]))
        lines.append(_row(f"Median {name} (ms):", s[f"median_{m}_ms"]))
        for p in percentiles:
            label = percentile_label(p)
            lines.append(_row(f"P{label} {name} (ms):", s[f"p{label}_{m}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)
