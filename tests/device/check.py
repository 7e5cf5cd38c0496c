"""`make test-device`: afd on one accelerator (a CUDA GPU or an Ascend NPU) against the CPU reference.

    .venv/bin/python tests/device/check.py [--checks pytest,colocated,gemm,ffngraph,paged,prefetch,1a1f,syncs,
        failure]
        [--write | --no-write]

Checks, each reported as pass / fail / skip with its reason and figures, its row saying what it measured
(one module each, tests/device/checks_*.py):
  pytest      the device-guarded tests (DEVICE_TESTS), run by pytest; skips keep pytest's reasons
  colocated   afd.LLM on the device vs afd.LLM on the CPU in fp32 (itself held to HF transformers), on the
              tests' tiny random checkpoints: fp32 gives identical greedy tokens, bf16 the same top-1 on
              >= 99 % of steps (near-ties aside) with logits close
  gemm        backend.grouped_matmul vs a per-expert torch.mm loop, bf16 and fp32: error and median time
  ffngraph    the FFN half's layers as device graphs (CUDA graphs / torchair) per token bucket, built at
              warm-up, vs the same layers eager on the CPU in fp32: error, per-expert counts, median time
  paged       MLA decode over the paged cache at contexts of one chunk and of four (4,096 tokens), vs the
              CPU in fp32 (FIA on Ascend where it fits): error, median step time
  prefetch    the FFN layer's time with the computed weight prefetch budget and without (afd/bench/prefetch.py's
              replay of the node's loop, 1 and 3 ms gaps); skipped on CUDA, where prefetch is a no-op
  1a1f        with two devices or more, `afd launch` of one attention node (device 0) and one FFN node
              (device 1) over NCCL / HCCL, greedy requests through the OpenAI API vs CPU fp32 tokens
  syncs       the same cluster: afd_host_syncs_total per decode step on each node, at most 1 + a slack
  failure     the same cluster under 16 streams: the FFN node killed (SIGKILL) mid-decode and started
              again; the attention node re-forms within rejoin_timeout, every stream ends with CPU fp32's
              tokens, and every wait has a deadline (a hang fails the row)

The table is printed and, when an accelerator ran the checks (or with --write), written with a JSON copy
to docs/bench/device/<device>-<date>.{md,json}. Without an accelerator the environment is reported,
every device check skips with the reason, nothing is written, and the exit code is 0. A GPU or NPU that
this machine has (visible_accelerators) but torch cannot use (the CPU wheel, no torch_npu, no driver)
is an error instead, in one line, exit code 2: that run would skip everything and pass. `--device cpu`
runs every check on the CPU instead (gloo for 1A1F): a dry run of this script where no device is.

This lives in tests/, not afd/bench/: it builds its checkpoints with transformers through the tests'
own builder (tests/hf_reference.py) and starts clusters with the tests' helpers, which the installed
package must not depend on.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(Path(__file__).parent)]  # the tests' checkpoint builder and helpers

# One module per check (checks_*.py), what they share in device_common.py, the machine in device_env.py.
import checks_1a1f  # noqa: E402
import checks_colocated  # noqa: E402
import checks_failure  # noqa: E402
import checks_ffn_graph  # noqa: E402
import checks_gemm  # noqa: E402
import checks_host_syncs  # noqa: E402
import checks_paged  # noqa: E402
import checks_prefetch  # noqa: E402
import checks_pytest  # noqa: E402
from device_common import Target, announce, guarded, say  # noqa: E402
from device_env import (  # noqa: E402  (main's steps, replaced by the tests)
    environment,
    find_target,
    print_environment,
    unusable_accelerator,
    visible_accelerators,
)
from device_report import Result, markdown_table, summary, write_report  # noqa: E402

OUT_DIR = ROOT / "docs" / "bench" / "device"
CHECKS = ("pytest", "colocated", "gemm", "ffngraph", "paged", "prefetch", "1a1f", "syncs", "failure")
TIME_BUDGET_S = 480  # `make test-device` promises at most 8 minutes on one device


# What the table lists when there is no accelerator: one skipped row per device check.
SKIPPED_WITHOUT_DEVICE = {
    "colocated": [
        ("colocated float32 vs CPU fp32", checks_colocated.MEASURED),
        ("colocated bfloat16 vs CPU fp32", checks_colocated.MEASURED),
    ],
    "gemm": [("grouped GEMM vs the per-expert loop", checks_gemm.MEASURED)],
    "ffngraph": [("FFN graphs vs CPU fp32", checks_ffn_graph.MEASURED)],
    "paged": [("paged MLA decode vs CPU fp32", checks_paged.MEASURED)],
    "prefetch": [("FFN prefetch vs none", checks_prefetch.MEASURED)],
    "1a1f": [("1A1F over NCCL / HCCL", checks_1a1f.MEASURED)],
    "syncs": [("host syncs per decode step, 1A1F", checks_host_syncs.MEASURED)],
    "failure": [("FFN node killed mid-decode, 1A1F", checks_failure.MEASURED)],
}
CLUSTER_CHECKS = {  # check -> (its function, its row's name if it raises, what it measures): a 1A1F cluster each
    "1a1f": (checks_1a1f.check_1a1f, "1A1F", checks_1a1f.MEASURED),
    "syncs": (checks_host_syncs.check_host_syncs, "host syncs per decode step", checks_host_syncs.MEASURED),
    "failure": (checks_failure.check_failure, "FFN node killed mid-decode", checks_failure.MEASURED),
}


def run_device_checks(args, target: Target) -> list[Result]:
    steps = 8 if args.quick else checks_colocated.STEPS
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="afd-device-ckpt-") as root:
        ckpts = {}
        if {"colocated", *CLUSTER_CHECKS} & set(args.checks):
            say("== building the tests' tiny random checkpoints (transformers; nothing is downloaded)")
            ckpts = checks_colocated.build_checkpoints(Path(root))
        if "colocated" in args.checks:
            for dtype in ("float32", "bfloat16"):
                say(f"== colocated {dtype} on {target.kind} vs CPU fp32")
                name = f"colocated {dtype} vs CPU fp32"
                run = functools.partial(checks_colocated.check_colocated, target, dtype, ckpts[dtype], steps)
                results.append(announce(guarded(run, name, checks_colocated.MEASURED)))
        if "gemm" in args.checks:
            say(f"== grouped GEMM on {target.kind} vs the per-expert loop")
            try:
                results += checks_gemm.check_gemm(target, args.quick)
            except Exception as e:  # the backend itself failed to start
                traceback.print_exc()
                results.append(
                    announce(Result("grouped GEMM", "fail", f"{type(e).__name__}: {e}", measured=checks_gemm.MEASURED))
                )
        if "ffngraph" in args.checks:
            for dtype in ("float32", "bfloat16"):
                say(f"== FFN graphs {dtype} on {target.kind} vs CPU fp32")
                run = functools.partial(checks_ffn_graph.check_ffn_graph, target, dtype)
                results.append(announce(guarded(run, f"FFN graphs {dtype} vs CPU fp32", checks_ffn_graph.MEASURED)))
        if "paged" in args.checks:
            for dtype in ("float32", "bfloat16"):
                say(f"== paged MLA decode {dtype} on {target.kind} vs CPU fp32")
                run = functools.partial(checks_paged.check_paged, target, dtype)
                results.append(announce(guarded(run, f"paged MLA decode {dtype} vs CPU fp32", checks_paged.MEASURED)))
        if "prefetch" in args.checks:
            say(f"== FFN prefetch on {target.kind}")
            run = functools.partial(checks_prefetch.check_prefetch, target, args.quick)
            results.append(announce(guarded(run, "FFN prefetch vs none", checks_prefetch.MEASURED)))
        for check, (fn, name, measured) in CLUSTER_CHECKS.items():
            if check in args.checks:
                say(f"== {name} over {target.dist}")
                ckpt = ckpts["float32"]["zero_experts"]
                arg = steps if check == "1a1f" else args.quick  # 1a1f compares `steps` tokens' prefix
                measured += SHARED if target.shared else ""
                results.append(announce(guarded(functools.partial(fn, target, ckpt, arg), name, measured)))
    return results


SHARED = "; both nodes on device 0 (cluster.share_devices): NCCL connects them over sockets, not P2P"


def device_plan(kind: str, count: int, checks: list[str]) -> list[str]:
    """What this script runs on `count` devices of `kind`, check by check: a line each, run or skip and why. The
    dry run (--device cpu) prints it for one GPU and for two, so that what a device machine will do is known
    before one is lent."""
    target = Target(kind, count)
    lines = []
    for check in checks:
        if check in CLUSTER_CHECKS and target.node_devices() is None:
            lines.append(f"  {check}: skip ({target.too_few_devices()})")
        elif check == "prefetch" and kind == "cuda":
            lines.append(f"  {check}: skip (prefetch is a no-op on CUDA)")
        elif check == "pytest":
            lines.append(f"  {check}: runs the device-guarded tests ({', '.join(checks_pytest.DEVICE_TESTS)})")
        else:
            rows = ", ".join(name for name, _ in SKIPPED_WITHOUT_DEVICE.get(check, [(check, "")]))
            shared = SHARED if check in CLUSTER_CHECKS and target.shared else ""
            lines.append(f"  {check}: runs ({rows}{shared})")
    return lines


def run_checks(args, target: Target | None, why: str) -> list[Result]:
    results = []
    if "pytest" in args.checks:
        say("== device tests (pytest)")
        results.append(announce(guarded(checks_pytest.check_pytest, "device tests (pytest)", checks_pytest.MEASURED)))
    if target is None:
        return results + [
            announce(Result(n, "skip", f"no accelerator: {why}", measured=measured))
            for c in CHECKS
            if c in args.checks
            for n, measured in SKIPPED_WITHOUT_DEVICE.get(c, [])
        ]
    return results + run_device_checks(args, target)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cuda", "npu", "cpu"),
        help="auto: an NPU if torch_npu sees one, else a CUDA GPU, else none (every device check "
        "skips); cpu: run every check on the CPU, a dry run of this script",
    )
    p.add_argument(
        "--checks",
        default=",".join(CHECKS),
        type=lambda s: [c.strip() for c in s.split(",") if c.strip()],
        help=f"comma-separated subset of {','.join(CHECKS)}",
    )
    p.add_argument("--quick", action="store_true", help="fewer steps, small GEMMs: a smoke run")
    p.add_argument(
        "--write",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write the .md/.json report (default: only when an accelerator ran the checks)",
    )
    p.add_argument("--out", type=Path, default=OUT_DIR, help="where the report goes")
    args = p.parse_args(argv)
    unknown = [c for c in args.checks if c not in CHECKS]
    if unknown:
        p.error(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    target, why = find_target(args.device)
    env = environment(target, why)
    print_environment(env)
    unusable = unusable_accelerator(visible_accelerators(), args.device) if target is None else None
    if unusable:  # else every device check would skip and the run pass on the machine it is for
        say(f"error: {unusable}")
        return 2
    if target is None and args.device != "auto":
        say(f"--device {args.device} asked for, but it is not usable here: {why}")
        return 2
    if target is None:
        say(f"== no accelerator: {why}. Every device check skips.")
    if args.device == "cpu":  # the dry run: what a device machine would run
        for count in (1, 2):
            say(f"== on {count} CUDA GPU(s) this would run:\n" + "\n".join(device_plan("cuda", count, args.checks)))
        say(
            "   (one GPU: both nodes of the 1A1F checks share it under cluster.share_devices, each with an NCCL_HOSTID"
            " of its own, so NCCL connects them as two hosts, over sockets: the failure semantics are tried, the"
            " exchange's figures are not P2P's. One NPU: skipped, HCCL takes one process per device)"
        )
    results = run_checks(args, target, why)
    seconds = time.perf_counter() - t0
    say("\n" + markdown_table(results))
    counts = summary(results)
    say(f"\n{counts['pass']} pass, {counts['fail']} fail, {counts['skip']} skip in {seconds:.0f}s")
    if target is not None and target.kind != "cpu" and seconds > TIME_BUDGET_S:
        say(f"note: over the {TIME_BUDGET_S // 60}-minute budget of this check on one device")
    accelerator_ran = target is not None and target.kind != "cpu"
    if args.write if args.write is not None else accelerator_ran:
        for path in write_report(args.out, env, results, sys.argv, seconds):
            say(f"wrote {path}")
    else:
        say(
            "nothing written ("
            + ("--no-write" if accelerator_ran else "no accelerator ran the checks; --write records this run anyway")
            + ")"
        )
    if target is None:
        say(f"no accelerator here, so every device check was skipped: {why}")
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
