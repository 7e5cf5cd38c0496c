"""`afd bench-step`: decode step time of colocated vs AFD (no overlap / overlap / ping-pong), side by side.

Every mode runs the same dummy-weights model, batch and prompt length; modes are interleaved over
`--repeats` rounds so that machine noise hits them alike; each figure is a median over decode steps
and then over rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

from afd.bench.common import count_flag, write_config
from afd.config.flags import DefaultsHelpFormatter

BENCH_CONFIG: dict[str, Any] = {  # an HF config.json's fields
    # Sized so that the attention window (dense MLP 0, attention 1, dense MLP 1) and the MoE take
    # comparable time on one CPU core at decode batch sizes.
    "model_type": "longcat_flash",
    "vocab_size": 1024,
    "hidden_size": 512,
    "num_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "ffn_hidden_size": 2048,
    "q_lora_rank": 256,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "head_dim": 16,
    "v_head_dim": 32,
    "moe_topk": 4,
    "n_routed_experts": 16,
    "zero_expert_num": 4,
    "expert_ffn_hidden_size": 768,
    "routed_scaling_factor": 6.0,
    "max_position_embeddings": 8192,
    "eos_token_id": 2,
}

# The other families at the same scale: hidden 512, 2 layers, 16 routed experts of 768, top-4.
QWEN3_MOE = {
    # No window at all: post_moe has nothing to do, so only ping-pong can hide the exchange.
    "model_type": "qwen3_moe",
    "vocab_size": 1024,
    "hidden_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 2048,
    "moe_intermediate_size": 768,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "max_position_embeddings": 8192,
    "eos_token_id": 2,
}
DEEPSEEK_V3 = {
    # The window is the shared expert (one of 768), computed while the routed experts are away.
    "model_type": "deepseek_v3",
    "vocab_size": 1024,
    "hidden_size": 512,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 0,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 256,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "intermediate_size": 2048,
    "moe_intermediate_size": 768,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "max_position_embeddings": 8192,
    "eos_token_id": 2,
    "bos_token_id": 0,
}

DEEPSEEK_V4 = {
    # No ScMoE window: only the shared expert (attention side) and ping-pong hide the exchange. The hash layer
    # routes by token id, so AFD modes run routing attention (afd.config.loader.check_routing). The window
    # and rates are shrunk so that a 64-token prompt reads compressed entries from the first decode step.
    "model_type": "deepseek_v4",
    "vocab_size": 1024,
    "hidden_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "head_dim": 64,
    "q_lora_rank": 256,
    "partial_rotary_factor": 0.25,
    "o_groups": 4,
    "o_lora_rank": 128,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 8,
    "sliding_window": 32,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
    "mlp_layer_types": ["hash_moe", "moe"],
    "hc_mult": 4,
    "moe_intermediate_size": 768,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "num_nextn_predict_layers": 0,
    "max_position_embeddings": 8192,
    "eos_token_id": 2,
    "bos_token_id": 0,
}

SCENARIOS = {
    "balanced": BENCH_CONFIG,
    # The MoE round trip is longer than the ScMoE window: the case ping-pong micro-batches are for.
    "ffn-heavy": {**BENCH_CONFIG, "ffn_hidden_size": 768, "moe_topk": 8, "expert_ffn_hidden_size": 1024},
    "qwen3-moe": QWEN3_MOE,
    "deepseek-v3": DEEPSEEK_V3,
    "deepseek-v4": DEEPSEEK_V4,
}

MODES: dict[str, dict[str, Any]] = {  # mode -> its settings: colocated, or overlap and micro_batches
    "colocated": dict(colocated=True),
    "afd --no-overlap": dict(overlap=False, micro_batches=1),
    "afd overlap (m=1)": dict(overlap=True, micro_batches=1),
    "afd ping-pong (m=2)": dict(overlap=True, micro_batches=2),
    "afd ping-pong (m=3)": dict(overlap=True, micro_batches=3),
    "afd auto m": dict(overlap=True, micro_batches=0),
}
DEFAULT_MODES = ("colocated", "afd --no-overlap", "afd overlap (m=1)", "afd ping-pong (m=2)", "afd auto m")


def add_model_args(p) -> None:
    """--model / --scenario: what every dummy-weights bench runs on."""
    p.add_argument("--model", default=None, help="checkpoint dir (config.json is enough: dummy weights)")
    p.add_argument(
        "--scenario", default="balanced", choices=list(SCENARIOS), help="built-in model size when --model is not given"
    )


def model_of(args, tmp: str) -> str:
    """The --model directory, or one in `tmp` holding the --scenario's config.json (dummy weights)."""
    return args.model if args.model is not None else write_config(tmp, SCENARIOS[args.scenario])


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench-step",
        help="decode step time: colocated vs AFD without/with overlap",
        formatter_class=DefaultsHelpFormatter,
    )
    add_model_args(p)
    count_flag(p, "--batch-size", 32)
    count_flag(p, "--prompt-len", 64)
    p.add_argument("--steps", type=_steps, default=24, help="decode steps per run (at least 3: 2 warm up untimed)")
    count_flag(p, "--repeats", 3)
    count_flag(p, "--attention-nodes", 1)
    count_flag(p, "--ffn-nodes", 1)
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma-separated subset of: " + ", ".join(MODES))
    p.add_argument(
        "--link",
        default=None,
        metavar="RATE[,DELAY]",
        help="run the FFN nodes behind an emulated link, e.g. 25gbit,20us (needs root; a delay needs "
        "the kernel's netem)",
    )
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.set_defaults(func=run)


def _steps(text: str) -> int:
    n = int(text)
    if n < 3:  # _summarize skips the first 2 decode steps (warm-up): fewer leave no step to time
        raise argparse.ArgumentTypeError(f"{n}: at least 3 (the first 2 decode steps warm up and are not timed)")
    return n


def _colocated(model: str, prompts, steps: int) -> list[dict]:
    from afd.bench.common import Colocated

    # one core, as each AFD node gets
    return Colocated(model, dummy_weights=True).generate(prompts, steps + 1, threads=1).steps


def _afd(model: str, prompts, steps: int, A: int, F: int, overlap: bool, micro_batches: int, link=None) -> list[dict]:
    from afd.cluster.local import LocalCluster
    from afd.cluster.local_config import local_job
    from afd.model.registry import load_config

    where = dict(link.hosts) if link is not None else {}
    if load_config(model).routes_by_token_ids:  # DeepSeek-V4's hash layers
        where["routing"] = "attention"
    job = local_job(
        model, A, F, dtype="float32", dummy_weights=True, overlap=overlap, micro_batches=micro_batches, **where
    )
    with LocalCluster(job, ffn_command_prefix=link.prefix if link is not None else ()) as cluster:
        cluster.start(prompts, steps + 1, ignore_eos=True)
        _, reports = cluster.wait()
        ffn = cluster.ffn_reports[0]
    busy = ffn["compute_seconds"] / max(1e-9, ffn["compute_seconds"] + ffn["idle_seconds"])
    # m: the micro-batch count the attention node ended on (the tuner's pick in auto mode)
    return [dict(s, ffn_busy=busy, m=reports[0].get("micro_batches")) for s in reports[0]["steps"]]


def _summarize(steps: list[dict], batch: int) -> dict:
    decode = [s for s in steps[1:] if s["tokens"] == batch][2:]  # skip prefill and warm-up steps
    total = sum(s["seconds"] for s in decode)
    return {
        "step_ms": 1e3 * statistics.median(s["seconds"] for s in decode),
        "wait_fraction": sum(s["ffn_wait"] for s in decode) / total if total else 0.0,
        "ffn_busy": steps[-1].get("ffn_busy"),
        "m": steps[-1].get("m"),
    }


def _link(spec):
    """The emulated link as a context (a null one without --link)."""
    import contextlib

    if spec is None:
        return contextlib.nullcontext()
    from afd.cluster.link import EmulatedLink

    return EmulatedLink(spec)


def run(args) -> int:
    modes = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    link_spec = None
    if args.link:
        from afd.cluster.link import LinkSpec

        link_spec = LinkSpec.parse(args.link)
    with tempfile.TemporaryDirectory() as tmp, _link(link_spec) as link:
        if link is not None:
            print(f"FFN nodes behind an emulated link: {link.qdisc} each way", flush=True)
        model = model_of(args, tmp)
        A, F = args.attention_nodes, args.ffn_nodes
        per_node = args.batch_size
        prompts = [[3 + (i * 7 + j) % 1000 for j in range(args.prompt_len)] for i in range(per_node * A)]
        rounds: dict[str, list[dict]] = {m: [] for m in modes}
        for r in range(args.repeats):
            for m in modes[r % len(modes) :] + modes[: r % len(modes)]:  # rotate the order each round
                t0 = time.perf_counter()
                if "colocated" in MODES[m]:
                    steps = _colocated(model, prompts[:per_node], args.steps)
                else:
                    steps = _afd(model, prompts, args.steps, A, F, MODES[m]["overlap"], MODES[m]["micro_batches"], link)
                rounds[m].append(_summarize(steps, per_node))
                print(
                    f"round {r + 1}/{args.repeats} {m}: {rounds[m][-1]['step_ms']:.2f} ms/step "
                    f"({time.perf_counter() - t0:.1f}s)",
                    flush=True,
                )
    results: dict[str, dict[str, Any]] = {  # step_ms and wait_fraction are always set; ffn_busy may be None
        m: {
            k: statistics.median(x[k] for x in v) if v[0][k] is not None else None
            for k in ("step_ms", "wait_fraction", "ffn_busy")
        }
        for m, v in rounds.items()
    }
    for m, v in rounds.items():  # the micro-batch count of each round (auto: what the tuner chose)
        results[m]["m"] = [x["m"] for x in v]
    base = results.get("afd --no-overlap", {}).get("step_ms")
    print(
        f"\n{args.model or args.scenario}: {A}A{F}F, batch {per_node} per attention node, prompt {args.prompt_len}, "
        f"{args.steps} decode steps, median of {args.repeats} rounds" + (f", link {args.link}" if args.link else "")
    )
    print(
        "| mode | decode step (ms) | attention waiting on FFN | FFN busy (compute / run) | vs --no-overlap "
        "| m per round |"
    )
    print("|---|---|---|---|---|---|")
    for m, res in results.items():
        speed = f"{base / res['step_ms']:.2f}x" if base else "-"
        busy = "-" if res["ffn_busy"] is None else f"{100 * res['ffn_busy']:.0f}%"
        used = ", ".join("-" if x is None else str(x) for x in res["m"])
        print(f"| {m} | {res['step_ms']:.2f} | {100 * res['wait_fraction']:.1f}% | {busy} | {speed} | {used} |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"config": vars(args) | {"func": None}, "results": results, "rounds": rounds}, f, indent=2)
    return 0
