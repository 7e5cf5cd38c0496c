"""`afd bench-quant`'s tables (afd.bench.quant measures; this prints): markdown, ratios beside the figures."""

from __future__ import annotations

from afd.bench.common import median

MB = 1 << 20


def print_all(res: dict, state: dict) -> None:
    print(f"\ncheckpoint: {res['checkpoint']}")
    for key, value in res.get("machine", {}).items():
        print(f"{key}: {value}")
    if "decode" in res:
        print_decode(res["decode"], state)
    if "gemm" in res:
        print_gemm(res["gemm"])
        if "decode" in res:
            print_bounds(res["decode"]["results"], res["gemm"])
    if "memory" in res:
        print_memory(res["memory"])
    if "wire" in res:
        print_wire(res["wire"])
    if res.get("kernels"):
        print_kernels(res["kernels"])


def print_kernels(kernels: dict) -> None:
    print("\nKernels chosen by timing on this machine (afd env; medians in ms):\n")
    print("| case | kernel | timed |")
    print("|---|---|---|")
    for label, entry in sorted(kernels.items()):
        timed = ", ".join(f"{k} {v:.3f}" for k, v in sorted(entry.get("medians_ms", {}).items()))
        print(f"| {label} | {entry.get('kernel')} | {timed} |")


def _ratios(xs: list[float | None], base: list[float | None]) -> str:
    return " / ".join("-" if x is None or b is None else f"{x / b:.2f}x" for x, b in zip(xs, base))


def print_decode(d: dict, state: dict) -> None:
    r, batches = d["results"], state["batches"]

    def tok(name: str) -> float | None:
        return r[name]["tok_s"] if name in r else None

    hf_cases = sorted({k.rsplit(" b=", 1)[0] for k in r if k.startswith("HF ")})  # "HF bf16 2t"
    # the bar: HF's fastest case at each batch, whatever its dtype and threads
    hf = [max((x for c in hf_cases if (x := tok(f"{c} b={b}")) is not None), default=None) for b in batches]
    cols = " | ".join(f"b={b}" for b in batches)
    print(f"\nDecode tok/s (median of interleaved rounds), {d['new_tokens']} tokens per sequence:\n")
    print(f"| topology | mode | {cols} | vs fp32 (same topology) | vs HF's fastest |")
    print("|---|---|" + "---|" * (len(batches) + 2))
    for t in state["topologies"]:
        for m in state["modes"]:
            xs = [tok(f"{t} {m} b={b}") for b in batches]
            base = [tok(f"{t} fp32 b={b}") for b in batches]
            figs = " | ".join("-" if x is None else f"{x:.0f}" for x in xs)
            print(f"| {t} | {m} | {figs} | {_ratios(xs, base)} | {_ratios(xs, hf)} |")
    for c in hf_cases:
        _, dtype, threads = c.split()
        xs = [tok(f"{c} b={b}") for b in batches]
        figs = " | ".join("-" if x is None else f"{x:.0f}" for x in xs)
        print(f"| HF generate, {threads[:-1]} thread(s) | {dtype} | {figs} | - | {_ratios(xs, hf)} |")
    pr = d.get("vs_fp32_per_round", {})
    print("\nvs fp32 round by round (each round's tok/s over fp32's in the same round): median (min-max)\n")
    print(f"| topology | mode | {cols} |")
    print("|---|---|" + "---|" * len(batches))
    for t in state["topologies"]:
        for m in state["modes"]:
            per = [pr.get(f"{t} {m} b={b}") for b in batches]  # each case's ratios, round by round
            figs = " | ".join("-" if not x else f"{median(x):.2f}x ({min(x):.2f}-{max(x):.2f})" for x in per)
            print(f"| {t} | {m} | {figs} |")
    print("\nQuantization each case ran with (colocated: the loaded half; 1A1F: the FFN node's log line):")
    for k, v in d["quantization"].items():
        print(f"- {k}: {v}")


def print_gemm(g: dict) -> None:
    r = g["results_ms"]
    modes = list(r)
    names = list(dict.fromkeys(k for m in modes for k in r[m]))  # every mode's probes, in order
    ratio = "fp32" in r and "w8a8" in r
    print(f"\nPer-GEMM ms at {g['tokens']} tokens, one thread (median of 30 calls, then of rounds):\n")
    print("| GEMM | " + " | ".join(modes) + (" | fp32 / w8a8 |" if ratio else " |"))
    print("|---|" + "---|" * (len(modes) + ratio))
    for k in names:
        figs = " | ".join(f"{r[m][k]:.3f}" if k in r[m] else "-" for m in modes)
        extra = (
            (f" | {r['fp32'][k] / r['w8a8'][k]:.2f}x" if k in r["fp32"] else " | -")
            if ratio and k in r["w8a8"]
            else (" | -" if ratio else "")
        )
        print(f"| {k} | {figs}{extra} |")


def bounds(decode: dict, gemm: dict) -> dict:
    """Per mode at the gemm section's batch T: the colocated step (one thread: A + F), F (the FFN half alone,
    one thread), A = the rest, 1A1F's ideal max(A, F) (its halves overlapped on a core each, nothing else),
    and the 1A1F step measured, with the share of it the attention node waited on the FFN node."""
    T, out = gemm["tokens"], {}
    for m, g in gemm["results_ms"].items():
        colo, afd = decode.get(f"colocated {m} b={T}"), decode.get(f"1A1F {m} b={T}")
        if colo is None:
            continue
        f = g["FFN half (all MoE layers)"]
        a = colo["step_ms"] - f
        out[m] = {"colocated": colo["step_ms"], "A": a, "F": f, "ideal_1a1f": max(a, f)}
        if afd is not None:
            out[m] |= {"1a1f": afd["step_ms"], "ffn_wait": afd["ffn_wait"]}
    return out


def print_bounds(decode: dict, gemm: dict) -> None:
    b = bounds(decode, gemm)
    if not b:
        return
    base = b.get("fp32")
    print(f"\nStep bounds at batch {gemm['tokens']} (ms; A = colocated step - F):\n")
    print("| mode | colocated (A + F) | F: FFN half alone | A | 1A1F ideal max(A, F) | 1A1F measured | waiting on FFN "
          "| ideal vs fp32 | measured vs fp32 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for m, x in b.items():
        got = f"{x['1a1f']:.1f} | {100 * x['ffn_wait']:.0f}%" if "1a1f" in x else "- | -"
        ideal = f"{base['ideal_1a1f'] / x['ideal_1a1f']:.2f}x" if base else "-"
        meas = f"{base['1a1f'] / x['1a1f']:.2f}x" if base and "1a1f" in x and "1a1f" in base else "-"
        print(
            f"| {m} | {x['colocated']:.1f} | {x['F']:.1f} | {x['A']:.1f} | {x['ideal_1a1f']:.1f} | {got} | {ideal} "
            f"| {meas} |"
        )


def print_memory(mem: dict) -> None:
    r = mem["results"]
    base = r.get("fp32")
    print("\nFFN node memory (MiB). Load delta: RSS after the FFN node's load path minus before it, one process:\n")
    print(
        "| mode | bench: experts | bench: load delta | bench: node RSS | large: experts | large: load delta "
        "| large: node RSS | large: node peak | vs fp32 (large: node RSS / load delta / experts) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for m, row in r.items():
        b, big = row["bench"], row["large"]
        delta = big["rss_after"] - big["rss_before"]
        vs = "-"
        if base:
            bb = base["large"]
            vs = " / ".join(
                f"{x / y:.2f}x"
                for x, y in (
                    (big["node_rss"], bb["node_rss"]),
                    (delta, bb["rss_after"] - bb["rss_before"]),
                    (big["expert_bytes"], bb["expert_bytes"]),
                )
            )
        node = f"{b['node_rss'] / MB:.0f}" if "node_rss" in b else "-"
        print(
            f"| {m} | {b['expert_bytes'] / MB:.1f} | {(b['rss_after'] - b['rss_before']) / MB:.0f} | {node} "
            f"| {big['expert_bytes'] / MB:.0f} | {delta / MB:.0f} | {big['node_rss'] / MB:.0f} "
            f"| {big['node_hwm'] / MB:.0f} | {vs} |"
        )
    print(
        "\nFFN node quantization (large model): "
        + "; ".join(f"{m}: {v['large']['ffn_quantization']}" for m, v in r.items())
    )


def print_wire(w: dict) -> None:
    print(
        f"\nWire bytes per decode step at batch {w['batch']} ({w['moe_layers']} MoE layers, 1A1F, {w['mode']}, "
        f"model {w['dtype']}; bf16 model by the formula):\n"
    )
    print(
        "| exchange_dtype | to_ffn / step | to_attention / step | bf16 model: to_ffn / to_attention "
        "| counted = formula (whole run) | tok/s |"
    )
    print("|---|---|---|---|---|---|")
    for ex, x in w["results"].items():
        s, h = x["per_step"], x["per_step_bf16_model"]
        same = (
            "yes"
            if x["counted_to_ffn"] == x["formula_to_ffn"]
            else f"NO ({x['counted_to_ffn']} vs {x['formula_to_ffn']})"
        )
        print(
            f"| {ex} | {s['to_ffn']} B | {s['to_attention']} B | {h['to_ffn']} B / {h['to_attention']} B | {same} "
            f"| {x['tok_s']:.0f} |"
        )
