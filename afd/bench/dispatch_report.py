"""The tables `afd bench-dispatch` prints (markdown, as docs/benchmarks/dispatch.md carries them)."""

from __future__ import annotations


def print_all(res: dict) -> None:
    m = res["model"]
    print(
        f"\ncheckpoint: {res['checkpoint']}; hidden {m['hidden']}, {m['n_routed']} routed experts top-{m['top_k']}, "
        f"{m['moe_layers']} MoE layers, {m['dtype']}"
    )
    la = res.get("load_average", {})
    if la:
        print(
            "load average (1, 5, 15 min) at start / end: "
            + " / ".join(", ".join(f"{x:.1f}" for x in v) for v in la.values())
        )
    if "wire" in res:
        print_wire(res["wire"])
    if "shapes" in res:
        print_shapes(res["shapes"])
    if "rebalance" in res:
        print_rebalance(res["rebalance"])


def print_wire(w: dict) -> None:
    print(
        "\nBytes per token per MoE layer to the FFN nodes (to_ffn), counted by the attention node, and the formula "
        "(wire_cost.per_token) at the measured and the expected fan-out; decode step (medians):\n"
    )
    print(
        "| F | routing | counted B/token/layer | of which counts | fan-out measured | formula @ measured "
        "| counted = formula | fan-out expected | formula @ expected | measured / expected | expert load max/mean "
        "| step ms | vs broadcast: bytes | vs broadcast: step (per round: median, range) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    res = w["results"]
    for r in res.values():
        base = res[f"F={r['ffn_nodes']} broadcast"]
        mid, lo, hi = r["step_vs_broadcast_per_round"]
        print(
            f"| {r['ffn_nodes']} | {r['routing']} | {r['counted']:.1f} | {r['counts_share']:.2f} | {r['fanout']:.3f} "
            f"| {r['formula_measured_fanout']:.1f} | {'yes' if r['counted_equals_formula'] else 'NO'} "
            f"| {r['expected_fanout']:.3f} | {r['formula_expected_fanout']:.1f} "
            f"| {r['formula_measured_fanout'] / r['formula_expected_fanout']:.3f} | {r['expert_skew']:.2f} "
            f"| {r['step_ms']:.2f} | {r['counted'] / base['counted']:.3f}x | {mid:.2f}x ({lo:.2f}-{hi:.2f}) |"
        )


def print_shapes(s: dict) -> None:
    print(
        "\nReal model shapes, by formula (default placement, bf16, exchange_dtype same), bytes per token per layer:\n"
    )
    print(
        "| model | F | fan-out expected (max) | broadcast to_ffn | dispatch to_ffn | dispatch / broadcast "
        "| broadcast to_attention | dispatch to_attention |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, v in s.items():
        for F, r in v["by_ffn_nodes"].items():
            extra = ""
            if "fanout_routed_only" in r:
                extra = f" ({r['ratio_routed_only']:.3f} at fan-out {r['fanout_routed_only']:.2f}: routed picks only)"
            print(
                f"| {name} | {F} | {r['fanout']:.2f} ({r['max_fanout']}) | {r['broadcast to_ffn']:.0f} "
                f"| {r['dispatch to_ffn']:.0f} | {r['ratio']:.3f}{extra} | {r['broadcast to_attention']:.0f} "
                f"| {r['dispatch to_attention']:.0f} |"
            )


def print_rebalance(r: dict) -> None:
    print(
        f"\nExpert-node load, 1A{r['ffn_nodes']}F, {r['prompts']}; rebalance() with {r['slots']} slots per node "
        "(max/mean over the FFN nodes):\n"
    )
    print(
        "| placement | computed (imbalance(), expert loads) | measured: expert assignments per node "
        "| measured: rows per node | step ms | experts per node |"
    )
    print("|---|---|---|---|---|---|")
    for k in ("before", "after"):
        m = r["measured"][k]
        held = "; ".join(f"{n}: {e}" for n, e in r[f"placement_{k}"].items())
        print(
            f"| {k} | {r['computed'][k]:.3f} | {m['assignments_max_mean']:.3f} | {m['rows_max_mean']:.3f} "
            f"| {m['step_ms']:.2f} | {held} |"
        )
    total = sum(r["expert_loads"])
    top = sorted(range(len(r["expert_loads"])), key=lambda e: -r["expert_loads"][e])[:4]
    print("\nhottest experts: " + ", ".join(f"{e} ({r['expert_loads'][e] / total:.1%})" for e in top))
