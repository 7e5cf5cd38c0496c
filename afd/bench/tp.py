"""`afd bench-tp`: attention-side TP, every tp_comm mode side by side on the same job.

Each mode runs a prefill of --batch-size prompts then --steps decode steps on a dummy-weights model at
--attention-tp G, next to a tp 1 baseline; modes are interleaved over --repeats rounds with the order
rotating each round, and each time is a median over steps and then over rounds (as `afd bench-step`).
Bytes are what rank 0 sent: in its TP group per prefill and decode step by formula
(afd.model.tp.volume.step_bytes), checked against what TPComm counted over the whole job, and its MoE
input to the FFN nodes (a2f), checked the same way.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

from afd.bench.common import at_least, count_flag, synthetic_prompts
from afd.bench.step import SCENARIOS, model_of
from afd.config.flags import DefaultsHelpFormatter
from afd.config.tp import MODES

BASELINE = "tp 1"
DTYPE_BYTES = 4  # the local cluster's float32


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench-tp", help="attention TP: step times and TP bytes per tp_comm mode", formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--model", default=None, help="checkpoint dir (config.json is enough: dummy weights)")
    p.add_argument(
        "--scenario",
        default="balanced",
        choices=[s for s in SCENARIOS if s != "qwen3-moe"],
        help="built-in model size when --model is not given (MLA families: TP cuts their heads)",
    )
    count_flag(p, "--attention-tp", 2, 1, "TP ranks G of the attention node")
    count_flag(p, "--ffn-nodes", 1, 0, "0: a colocated cluster (the ranks hold every expert)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES))
    p.add_argument(
        "--flashcomm2-otp", type=at_least(1), default=None, help="flashcomm2's P (default G / 2; at least 1)"
    )
    p.add_argument(
        "--tp-comm-min-tokens",
        type=at_least(1),
        default=1,
        help="micro-batches below this run as allreduce (1: every mode shards every step; at least 1)",
    )
    count_flag(p, "--batch-size", 32)
    count_flag(p, "--prompt-len", 64)
    count_flag(p, "--steps", 24, 1, "decode steps per run")
    count_flag(p, "--repeats", 3)
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.set_defaults(func=run)


def _tp_config(args, mode: str):
    from afd.config.tp import TPConfig

    if mode == BASELINE:
        return TPConfig(1)
    otp = (args.flashcomm2_otp or max(1, args.attention_tp // 2)) if mode == "flashcomm2" else None
    return TPConfig(args.attention_tp, mode, otp, args.tp_comm_min_tokens)


def _job(model: str, prompts, steps: int, F: int, tp) -> dict:
    """Rank 0's report of one run: one prefill step of every prompt, then `steps` decode steps."""
    from afd.cluster.local import LocalCluster
    from afd.cluster.local_config import local_job

    # one micro-batch per step, so that a step's TP bytes are one step_bytes
    job = local_job(
        model,
        1,
        F,
        dtype="float32",
        dummy_weights=True,
        micro_batches=1,
        attention_tp=tp.size,
        **({} if tp.size == 1 else dict(tp_comm=tp.mode, flashcomm2_otp=tp.otp, tp_comm_min_tokens=tp.min_tokens)),
    )
    with LocalCluster(job) as cluster:
        cluster.start(prompts, steps + 1, ignore_eos=True)
        _, reports = cluster.wait()
    return reports[0]


def _formula(cfg, tp, steps: list[dict], batch: int, F: int) -> dict:
    """Rank 0's bytes by formula: per prefill and decode step, and summed over the job's steps."""
    from afd.model.tp.volume import step_bytes, volume

    def tp_bytes(tokens: int) -> int:
        return sum(step_bytes(cfg, tp, tokens, DTYPE_BYTES, seqs=batch).values())

    def a2f(tokens: int) -> int:
        return len(cfg.moe_layers) * volume(cfg, tp, tokens, DTYPE_BYTES).to_ffn[0] * F

    prefill, decode = steps[0]["tokens"], batch
    return {
        "tp_prefill": tp_bytes(prefill),
        "tp_decode": tp_bytes(decode),
        "a2f_decode": a2f(decode),
        "tp_job": sum(tp_bytes(s["tokens"]) for s in steps),
        "a2f_job": sum(a2f(s["tokens"]) for s in steps),
    }


def _summarize(report: dict, cfg, tp, batch: int, F: int) -> dict:
    steps = report["steps"]
    decode = [s for s in steps[1:] if s["tokens"] == batch]
    decode = decode[2:] or decode  # skip warm-up steps
    bytes_ = _formula(cfg, tp, steps, batch, F)
    counted_tp, counted_a2f = sum(report.get("tp_bytes", {}).values()), report.get("a2f_bytes", 0)
    return {
        "prefill_ms": 1e3 * steps[0]["seconds"],
        "decode_ms": 1e3 * statistics.median(s["seconds"] for s in decode),
        **bytes_,
        "tp_job_counted": counted_tp,
        "a2f_job_counted": counted_a2f,
        "bytes_match": counted_tp == bytes_["tp_job"] and counted_a2f == bytes_["a2f_job"],
        "tp_fallbacks": report.get("tp_fallbacks", {}),
    }


def _kib(n: int) -> str:
    return f"{n / 1024:.1f}"


def _print_table(args, results: dict, label: str) -> None:
    G, F = args.attention_tp, args.ffn_nodes
    where = " (colocated: the ranks hold every expert)" if F == 0 else ""
    shards = " (every mode shards every step)" if args.tp_comm_min_tokens <= 1 else ""
    print(
        f"\n{label}: attention_tp {G}, {F} FFN node(s){where}, batch {args.batch_size}, prompt {args.prompt_len}, "
        f"{args.steps} decode steps, median of {args.repeats} rounds; tp_comm_min_tokens "
        f"{args.tp_comm_min_tokens}{shards}"
    )
    print(f"CPU figures: gloo collectives, {G} + {F} processes sharing {os.cpu_count()} cores; not NPU (HCCL) figures")
    print(
        "| mode | prefill step (ms) | decode step (ms) | decode vs tp 1 | TP KiB / rank / prefill step "
        "| TP KiB / rank / decode step | TP bytes of the job: counted / formula | A2F KiB / rank / decode step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    base = results.get(BASELINE, {}).get("decode_ms")
    for m, r in results.items():
        speed = f"{base / r['decode_ms']:.2f}x" if base else "-"
        check = f"{r['tp_job_counted']} / {r['tp_job']}" + ("" if r["bytes_match"] else " MISMATCH")
        print(
            f"| {m} | {r['prefill_ms']:.2f} | {r['decode_ms']:.2f} | {speed} | {_kib(r['tp_prefill'])} "
            f"| {_kib(r['tp_decode'])} | {check} | {_kib(r['a2f_decode'])} |"
        )


def run(args) -> int:
    from afd.model.registry import load_config

    modes = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    rows = [BASELINE, *modes]
    tps = {m: _tp_config(args, m) for m in rows}  # validates G, P and the threshold before any run
    with tempfile.TemporaryDirectory() as tmp:
        model = model_of(args, tmp)
        cfg = load_config(model)
        for tp in tps.values():
            tp.check_model(cfg.num_attention_heads, "--attention-tp")
        B, F = args.batch_size, args.ffn_nodes
        prompts = synthetic_prompts(B, args.prompt_len, cfg.vocab_size)  # ids inside the model's vocabulary
        rounds: dict[str, list[dict]] = {m: [] for m in rows}
        for r in range(args.repeats):
            for m in rows[r % len(rows) :] + rows[: r % len(rows)]:  # rotate the order each round
                t0 = time.perf_counter()
                rounds[m].append(_summarize(_job(model, prompts, args.steps, F, tps[m]), cfg, tps[m], B, F))
                x = rounds[m][-1]
                print(
                    f"round {r + 1}/{args.repeats} {m}: prefill {x['prefill_ms']:.2f} ms, decode "
                    f"{x['decode_ms']:.2f} ms/step ({time.perf_counter() - t0:.1f}s)",
                    flush=True,
                )
    results = {
        m: {
            **v[-1],
            **{k: statistics.median(x[k] for x in v) for k in ("prefill_ms", "decode_ms")},
            "bytes_match": all(x["bytes_match"] for x in v),
        }
        for m, v in rounds.items()
    }
    for m in modes:
        results[m]["otp"] = tps[m].otp
    _print_table(args, results, args.model or args.scenario)
    ok = all(r["bytes_match"] for r in results.values())
    print(
        "TP and A2F bytes: counted == formula in every run"
        if ok
        else "MISMATCH: counted TP/A2F bytes differ from afd.model.tp.volume's formula (see the JSON)"
    )
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"config": vars(args) | {"func": None}, "results": results, "rounds": rounds}, f, indent=2)
    return 0 if ok else 1
