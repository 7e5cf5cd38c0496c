"""`afd bench-dispatch`: attention-side routing (layout.routing attention) against broadcast (routing ffn), and
expert placement by `afd rebalance`, side by side in one run.

Sections (--sections):
  wire       1A{F}F local clusters (gloo, one thread per node, overlap, one micro-batch) for each F in
             --ffn-nodes, each under routing ffn and routing attention, all kept up: one job per case and
             round, interleaved rounds whose order rotates, medians. Per case: the bytes per token per MoE layer
             the attention node counted it sent (the count afd_exchange_bytes_total{direction="to_ffn"}
             exports), the fan-out the FFN nodes saw (rows they received, afd_ffn_tokens_total, over tokens and
             layers), afd.dataplane.wire_cost.per_token at that fan-out (and the check that it gives the counted
             bytes exactly) and at the expected fan-out of uniform routing (afd.config.placement), and the decode
             step time;
  shapes     wire_cost.per_token on DeepSeek-V3, Qwen3-235B-A22B and LongCat-Flash shapes at --shape-ffn-nodes,
             default placement, bf16: broadcast vs dispatch bytes and their ratio (formula only);
  rebalance  a 1A{F}F cluster (--rebalance-ffn-nodes) on a skewed prompt set: the experts' loads from the FFN
             nodes' afd_expert_tokens_total, afd.cluster.rebalance.rebalance() on them (--expert-slots), its
             max/mean node load before and after as computed (imbalance()), and as measured: a second cluster
             started with the new placement, the same prompts on both in interleaved rounds, each node's expert
             assignments and rows read from its /metrics.

The checkpoint: --model, or the demo model with 16 routed experts top-2 and no identity experts
(afd.bench.dispatch_parts.BENCH_MODEL) written with random weights (seed 0) as safetensors.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from afd.bench import dispatch_parts as parts
from afd.bench.common import at_least, count_flag, interleaved, median, synthetic_prompts
from afd.config.flags import DefaultsHelpFormatter

SECTIONS = ("wire", "shapes", "rebalance")
ROUTINGS = {"broadcast": "ffn", "dispatch": "attention"}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench-dispatch",
        help="attention-side routing vs broadcast: bytes per token and step time; rebalance's effect on load",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--model", default=None, help="checkpoint dir (default: 16 experts top-2, random weights)")
    p.add_argument("--dtype", default="float32", help="model.dtype of the clusters")
    p.add_argument("--ffn-nodes", default="1,2,3,4", help="FFN node counts of the wire section")
    count_flag(p, "--batch", 16)
    count_flag(p, "--prompt-len", 16)
    count_flag(p, "--steps", 12, 1, "decode steps measured per job (after --warmup-steps)")
    count_flag(p, "--warmup-steps", 2, 0)
    count_flag(p, "--repeats", 3, 1, "interleaved rounds")
    p.add_argument("--shape-ffn-nodes", default="8,16,32", help="FFN node counts of the shapes section")
    count_flag(p, "--rebalance-ffn-nodes", 4, 2)
    count_flag(p, "--skewed-prompts", 24, 1, "prompts of the rebalance section's job")
    count_flag(p, "--distinct-prompts", 3, 1, "distinct prompts among them (repeated)")
    p.add_argument(
        "--expert-slots",
        type=at_least(1),
        default=None,
        help="per FFN node; default as `afd rebalance`: largest + 25%% (at least 1)",
    )
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of: " + ", ".join(SECTIONS))
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.set_defaults(func=run)


def _log(msg: str) -> None:
    print(f"  .. {msg}", flush=True)


def _start(path: str, dummy: bool, dtype: str, F: int, routing: str, placement: dict | None = None):
    from afd.cluster.local_config import local_job

    job = local_job(
        path,
        1,
        F,
        dtype=dtype,
        dummy_weights=dummy,
        overlap=True,
        micro_batches=1,
        routing=routing,
        placement=placement,
    )
    cluster = parts.MetricsCluster(job)
    cluster.start()
    cluster.generate([[3, 4, 5, 6]], 2, ignore_eos=True)  # loaded and warm
    return cluster


def section_wire(args, path: str, dummy: bool, cfg) -> dict:
    from afd.config.placement import default_placement, routed_fanout

    Fs = [int(f) for f in args.ffn_nodes.split(",")]
    L, K, E = len(cfg.moe_layers), cfg.experts_per_token, cfg.n_routed_experts
    cases = {f"F={F} {name}": (F, r) for F in Fs for name, r in ROUTINGS.items()}
    prompts = synthetic_prompts(args.batch, args.prompt_len, cfg.vocab_size)
    n = args.steps + args.warmup_steps + 1
    clusters = {}
    try:
        for name, (F, r) in cases.items():
            _log(f"starting 1A{F}F routing {r}")
            clusters[name] = _start(path, dummy, args.dtype, F, r)
        rounds = interleaved(
            list(cases), args.repeats, lambda c, _: parts.run_job(clusters[c], prompts, n, args.warmup_steps, E), _log
        )
    finally:
        for c in clusters.values():
            c.close()
    results: dict[str, dict[str, Any]] = {}  # case -> its medians, and what the case was
    for name, (F, r) in cases.items():
        groups, topk_group = cfg.expert_groups
        p = default_placement(E, [f"ffn{i}" for i in range(F)], groups)
        fan = routed_fanout(p, K, groups, topk_group, cfg.identity_experts)
        figs = [parts.wire_figures(j, F, r, L, cfg.hidden_size, args.dtype, K, fan) for j in rounds[name]]
        keys = [k for k in figs[0] if k != "counted_equals_formula"]
        results[name] = {k: median(f[k] for f in figs) for k in keys}
        base = rounds[f"F={F} broadcast"]  # the same round's broadcast case: the drift of a shared machine cancels
        per_round = [j["step_ms"] / b["step_ms"] for j, b in zip(rounds[name], base)]
        results[name] |= {
            "counted_equals_formula": all(f["counted_equals_formula"] for f in figs),
            "step_ms": median(j["step_ms"] for j in rounds[name]),
            "step_vs_broadcast_per_round": [median(per_round), min(per_round), max(per_round)],
            "expert_skew": median(parts.max_mean(j["expert_loads"]) for j in rounds[name]),
            "ffn_nodes": F,
            "routing": r,
        }
    return {"results": results, "rounds": rounds, "moe_layers": L, "top_k": K, "n_routed": E, "new_tokens": n}


def section_rebalance(args, path: str, dummy: bool, cfg) -> dict:
    from afd.cluster.rebalance import imbalance, node_loads, rebalance
    from afd.config.placement import default_placement

    F, E = args.rebalance_ffn_nodes, cfg.n_routed_experts
    nodes = [f"ffn{i}" for i in range(F)]
    current = default_placement(E, nodes, cfg.expert_groups[0])
    slots = args.expert_slots or max(len(h) for h in current.held) + -(-E // (4 * F))
    prompts = parts.skewed_prompts(args.skewed_prompts, args.prompt_len, cfg.vocab_size, args.distinct_prompts)
    n = args.steps + args.warmup_steps + 1
    clusters = {}
    try:
        _log(f"starting 1A{F}F, default placement")
        clusters["before"] = _start(path, dummy, args.dtype, F, "attention")
        first = parts.run_job(clusters["before"], prompts, n, args.warmup_steps, E)
        loads = first["expert_loads"]
        new = rebalance(loads, nodes, slots, current)
        _log(f"starting 1A{F}F, rebalanced placement {new.to_yaml()}")
        placement = new.to_yaml()
        clusters["after"] = _start(path, dummy, args.dtype, F, "attention", placement)
        job = lambda c, _: parts.run_job(clusters[c], prompts, n, args.warmup_steps, E)  # noqa: E731
        rounds = interleaved(["before", "after"], args.repeats, job, _log)
    finally:
        for c in clusters.values():
            c.close()

    measured = {
        k: {
            "assignments_max_mean": median(parts.max_mean(j["node_assignments"].values()) for j in v),
            "rows_max_mean": median(parts.max_mean(j["node_rows"].values()) for j in v),
            "step_ms": median(j["step_ms"] for j in v),
            "node_assignments": v[0]["node_assignments"],
            "node_rows": v[0]["node_rows"],
        }
        for k, v in rounds.items()
    }
    return {
        "ffn_nodes": F,
        "slots": slots,
        "prompts": f"{args.skewed_prompts} prompts ({args.distinct_prompts} distinct: one token x {args.prompt_len})",
        "expert_loads": loads,
        "placement_before": current.to_yaml(),
        "placement_after": new.to_yaml(),
        "computed": {"before": imbalance(current, loads), "after": imbalance(new, loads)},
        "computed_node_loads": {"before": node_loads(current, loads), "after": node_loads(new, loads)},
        "measured": measured,
        "rounds": rounds,
    }


def run(args) -> int:
    from afd.bench import dispatch_report
    from afd.model.registry import load_config

    sections = [s.strip() for s in args.sections.split(",")]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        raise ValueError(f"unknown section(s) {bad}; choose from {', '.join(SECTIONS)}")
    res: dict = {"load_average": {"start": os.getloadavg()}}  # the machine's other work: it moves the step times
    with tempfile.TemporaryDirectory() as tmp:
        path, dummy = parts.bench_checkpoint(args.model, tmp)
        cfg = load_config(path)
        res["checkpoint"] = "dummy weights" if dummy else "safetensors, random weights (seed 0)"
        res["model"] = {"hidden": cfg.hidden_size, "n_routed": cfg.n_routed_experts, "top_k": cfg.experts_per_token,
                        "moe_layers": len(cfg.moe_layers), "dtype": args.dtype}  # fmt: skip
        if "wire" in sections:
            res["wire"] = section_wire(args, path, dummy, cfg)
        if "shapes" in sections:
            res["shapes"] = parts.shape_figures([int(f) for f in args.shape_ffn_nodes.split(",")])
        if "rebalance" in sections:
            res["rebalance"] = section_rebalance(args, path, dummy, cfg)
    res["load_average"]["end"] = os.getloadavg()
    dispatch_report.print_all(res)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"config": vars(args) | {"func": None}} | res, f, indent=1)
    return 0
