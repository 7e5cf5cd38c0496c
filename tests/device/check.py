"""`make test-device`: afd on one accelerator (a CUDA GPU or an Ascend NPU) against the CPU reference.

    .venv/bin/python tests/device/check.py [--checks pytest,colocated,gemm,1a1f] [--write | --no-write]

Checks, each reported as pass / fail / skip with its reason and figures:
  pytest      the device-guarded tests (DEVICE_TESTS), run by pytest; skips keep pytest's reasons
  colocated   afd.LLM on the device vs afd.LLM on the CPU in fp32 (itself held to HF transformers), on the
              tests' tiny random checkpoints: fp32 gives identical greedy tokens, bf16 the same top-1 on
              >= 99 % of steps (near-ties aside) with logits close
  gemm        backend.grouped_matmul vs a per-expert torch.mm loop, bf16 and fp32: error and median time
  1a1f        with two devices or more, `afd launch` of one attention node (device 0) and one FFN node
              (device 1) over NCCL / HCCL, greedy requests through the OpenAI API vs CPU fp32 tokens

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
import contextlib
import datetime as dt
import functools
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(Path(__file__).parent)]  # the tests' checkpoint builder and helpers

from device_report import Result, markdown_table, summary, write_report  # noqa: E402
from hf_reference import PROMPTS, TINY_CONFIGS, make_hf_checkpoint  # noqa: E402

OUT_DIR = ROOT / "docs" / "bench" / "device"
CHECKS = ("pytest", "colocated", "gemm", "1a1f")
# The device-guarded tests (a skipif on the device or its SDK). Add new ones here.
DEVICE_TESTS = (
    "tests/test_cuda.py",
    "tests/test_graph_cuda.py",
    "tests/test_backend_and_sampling.py::test_cuda_grouped_matmul",
    "tests/test_backend_and_sampling.py::test_npu_backend_fails_clearly_without_torch_npu",
    "tests/test_prefetch.py::test_npu_prefetch_for_real",
)
PYTEST_TIMEOUT = 300

BLOCK_SIZE = 4  # as the tests: the longest prompt spans several KV blocks
STEPS = 32  # greedy steps per prompt: 4 prompts x 4 checkpoints x 32 = 512 compared steps per dtype
MAX_ROUNDS = 6  # teacher-forcing rounds before a run that keeps disagreeing is cut short (and fails)
# bf16 runs on the same configs built with weights of std 0.05 instead of the tests' 0.2. The tests' large
# weights (chosen so that routing is far from uniform) amplify bf16 rounding: even the CPU's bf16 then shows
# logit errors up to 17 % of the largest logit and 94-98 % top-1 agreement, teacher-forced, so no threshold
# could tell a device bug from rounding. CPU bf16 vs CPU fp32 at std 0.05 (`--device cpu`), 512 steps: strict
# top-1 97.7 %, up to near-ties 99.8 %; logits error median 0.008, p99 0.024, max 0.076.
BF16_WEIGHT_STD = 0.05
MIN_TOP1 = 0.99  # bf16: share of steps whose top-1 agrees up to a near-tie
# A step agrees "up to a near-tie" when the device's token is the reference's top-1, or one the reference
# scores within TIE x max|logit| of its top-1: rounding alone flips such choices (11 of CPU bf16's 12 strict
# mismatches above were at reference gaps under 0.02).
TIE = 0.02
# "Logits close": each step's error e = max |device - ref| / max |ref|, bounded per statistic over all steps.
# fp32: every step's e <= 1e-3: loose for IEEE fp32 (~1e-6 expected), yet trips on TF32/HF32 matmuls.
# bf16: median <= 0.02 and p99 <= 0.05, 2.5x and 2x CPU bf16's figures. No bound on the max: CPU bf16 has
# 2 steps in 512 above 0.05, single jumps (likely rounding flipping a token's expert choice) that are not bugs.
LOGITS_TOL = {"float32": {"max": 1e-3}, "bfloat16": {"median": 0.02, "p99": 0.05}}
GEMM_TOL = {"float32": 1e-4, "bfloat16": 2e-2}  # max |grouped - loop| / max |loop|
API_TOKENS = 16  # greedy tokens per request in the 1A1F check
CLUSTER_READY_TIMEOUT = 240
TIME_BUDGET_S = 480  # `make test-device` promises at most 8 minutes on one device


@dataclass
class Target:
    """Where the device checks run: kind is cuda, npu, or cpu (the --device cpu dry run)."""

    kind: str
    count: int

    @property
    def dist(self) -> str:
        return {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}[self.kind]


def say(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------------------
# environment


def _try(fn: Callable, default=None):
    """fn(), or `default` when it raises: an environment report lists what it can find, never fails."""
    try:
        return fn()
    except Exception:
        return default


def _cuda_usable() -> tuple[bool, str]:
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return False, f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)"
    if not torch.cuda.is_available():
        return False, (
            f"torch.cuda.is_available() is False (torch {torch.__version__}, CUDA "
            f"{torch.version.cuda}): no GPU visible, or no driver"
        )
    return True, ""


def _npu_usable() -> tuple[bool, str]:
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ModuleNotFoundError as e:
        if e.name == "torch_npu":
            return False, "torch_npu is not installed"
        return False, f"torch_npu does not import ({e})"
    except Exception as e:  # installed but broken, e.g. CANN's environment not sourced
        return False, f"torch_npu does not import ({type(e).__name__}: {e})"
    if not _try(torch.npu.is_available, False):
        return False, "torch_npu imports but torch.npu.is_available() is False"
    return True, ""


def find_target(requested: str) -> tuple[Target | None, str]:
    """The accelerator the checks run on, or (None, why there is none). `auto` prefers an NPU, then CUDA."""
    if requested == "cpu":
        return Target("cpu", 1), ""
    why = []
    for kind, usable in (("npu", _npu_usable), ("cuda", _cuda_usable)):
        if requested not in ("auto", kind):
            continue
        ok, msg = usable()
        if ok:
            return Target(kind, getattr(torch, kind).device_count()), ""
        why.append(msg)
    return None, "; ".join(why)


def visible_accelerators() -> dict[str, str]:
    """The accelerators this machine shows, whether torch can use them or not: {kind: what shows it}. A GPU
    is listed by `nvidia-smi -L` (or has /dev/nvidia0), an Ascend NPU answers `npu-smi info` (or has
    /dev/davinci0)."""
    seen = {}
    gpus = [ln for ln in (_command_output(["nvidia-smi", "-L"]) or "").splitlines() if ln.startswith("GPU ")]
    if gpus:
        seen["cuda"] = f"nvidia-smi -L lists {len(gpus)} GPU{'s' if len(gpus) > 1 else ''}"
    elif os.path.exists("/dev/nvidia0"):
        seen["cuda"] = "/dev/nvidia0 exists"
    if _command_output(["npu-smi", "info"]) is not None:
        seen["npu"] = "npu-smi info answers"
    elif os.path.exists("/dev/davinci0"):
        seen["npu"] = "/dev/davinci0 exists"
    return seen


def unusable_accelerator(seen: dict[str, str], requested: str = "auto") -> str | None:
    """Why the run must fail before any check: an accelerator this machine has (`seen`, of the kind asked
    for) that torch cannot use, e.g. the CPU wheel on a GPU machine, where every device check would skip
    and the run pass. None when torch can use each one (or none is here)."""
    for kind, shown in seen.items():
        if requested not in ("auto", kind):
            continue
        ok, why = {"cuda": _cuda_usable, "npu": _npu_usable}[kind]()
        if ok:
            continue
        if kind == "npu":
            return (
                f"torch {torch.__version__} cannot use the NPU this machine has ({shown}): {why}; install the "
                "torch_npu release for this torch and source CANN's set_env.sh"
            )
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return (
                f"torch {torch.__version__} is a CPU-only build and cannot use the GPU this machine has "
                f"({shown}): install a CUDA build of torch (see the Makefile's TORCH_SPEC)"
            )
        return f"torch {torch.__version__} cannot use the GPU this machine has ({shown}): {why}"
    return None


def _command_output(argv: list[str]) -> str | None:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _cuda_env() -> dict:
    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        devices.append(
            {
                "index": i,
                "name": p.name,
                "capability": f"{p.major}.{p.minor}",
                "memory_gib": round(p.total_memory / 2**30, 1),
                "multiprocessors": p.multi_processor_count,
            }
        )
    nccl = _try(torch.cuda.nccl.version)
    smi = _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {
        "devices": devices,
        "cuda_runtime": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "driver": smi.splitlines()[0] if smi else None,
        "cudnn": _try(torch.backends.cudnn.version),
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        # natively: since torch 2.2 the bare call also says True where bf16 is only emulated
        "bf16_supported": _try(
            lambda: torch.cuda.is_bf16_supported(including_emulation=False), _try(torch.cuda.is_bf16_supported)
        ),
    }


def _npu_env() -> dict:
    import torch_npu

    def cann(module: str):
        return _try(lambda: torch_npu.npu.utils.get_cann_version(module=module)) or None

    devices = []
    for i in range(torch.npu.device_count()):
        mem = _try(lambda i=i: torch.npu.get_device_properties(i).total_memory)
        devices.append(
            {
                "index": i,
                "name": _try(lambda i=i: torch.npu.get_device_name(i)),
                "memory_gib": round(mem / 2**30, 1) if mem else None,
            }
        )
    bf16 = getattr(torch.npu, "is_bf16_supported", None)
    return {
        "devices": devices,
        "torch_npu": getattr(torch_npu, "__version__", None),
        "cann": cann("CANN") or getattr(torch.version, "cann", None),
        "driver": cann("DRIVER"),
        "bf16_supported": _try(bf16) if bf16 else None,
    }


def environment(target: Target | None, why: str) -> dict:
    import afd

    env = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda_build": torch.version.cuda,
        "afd": afd.__version__,
        "afd_commit": _command_output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cpu_threads": torch.get_num_threads(),
        "device_type": target.kind if target else "none",
        "device_count": target.count if target else 0,
    }
    if target is None:
        env["no_accelerator"] = why
    elif target.kind == "cuda":
        env.update(_cuda_env())
    elif target.kind == "npu":
        env.update(_npu_env())
    return env


def print_environment(env: dict) -> None:
    say("== environment")
    width = max(map(len, env))
    for k, v in env.items():
        if k == "devices":
            for d in v:
                say(f"  {'device':<{width}}  " + ", ".join(f"{a}={b}" for a, b in d.items()))
        else:
            say(f"  {k:<{width}}  {v}")


def dtype_supported(target: Target, dtype: str) -> tuple[bool, str]:
    """Whether the device computes in `dtype`: the SDK's own answer where it has one, then a real matmul."""
    if target.kind == "cpu":
        return True, ""
    if dtype == "bfloat16":
        query = getattr(getattr(torch, target.kind), "is_bf16_supported", None)
        if query is not None and not _try(query, True):
            return False, f"torch.{target.kind}.is_bf16_supported() is False"
    try:
        a = torch.ones(8, 8, dtype=getattr(torch, dtype), device=f"{target.kind}:0")
        (a @ a).sum().item()
    except Exception as e:
        return False, f"a {dtype} matmul fails on {target.kind}:0 ({type(e).__name__}: {e})"
    return True, ""


# ---------------------------------------------------------------------------------------------------------
# check: the device-guarded tests


def parse_junit(path: Path) -> dict:
    """Counts and the skip reasons / failures of a pytest --junitxml report."""
    out = {"passed": 0, "failed": 0, "skipped": 0, "skips": [], "failures": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            out["failed"] += 1
            first_line = ((bad.get("message") or "").splitlines() or [""])[0]
            out["failures"].append(f"{name}: {first_line[:200]}")
        elif skip is not None:
            out["skipped"] += 1
            out["skips"].append(skip.get("message") or "")
        else:
            out["passed"] += 1
    return out


def _skip_summary(skips: list[str]) -> str:
    counts: dict[str, int] = {}
    for s in skips:
        counts[s] = counts.get(s, 0) + 1
    return "; ".join(f"{s} (x{n})" if n > 1 else s for s, n in counts.items())


def check_pytest() -> Result:
    name = "device tests (pytest)"
    with tempfile.TemporaryDirectory(prefix="afd-device-pytest-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            f"--junitxml={xml}",
            *DEVICE_TESTS,
        ]
        say("$ python " + " ".join(cmd[1:]))
        rc = subprocess.run(cmd, cwd=ROOT, timeout=PYTEST_TIMEOUT).returncode
        if not xml.exists():
            return Result(name, "fail", f"pytest exited with {rc} and wrote no report")
        got = parse_junit(xml)
    figures = {k: got[k] for k in ("passed", "failed", "skipped")}
    if got["failed"] or rc != 0:
        return Result(name, "fail", "; ".join(got["failures"]) or f"pytest exited with {rc}", figures)
    note = f"skipped: {_skip_summary(got['skips'])}" if got["skips"] else "none skipped"
    if not got["passed"]:
        return Result(name, "skip", note, figures)
    return Result(name, "pass", f"{got['passed']} passed; {note}", figures)


# ---------------------------------------------------------------------------------------------------------
# check: colocated generation on the device vs the CPU reference


def build_checkpoints(root: Path) -> dict[str, dict[str, str]]:
    """dtype -> {label: checkpoint dir}: the tests' TINY_CONFIGS as the tests build them (fp32, and the
    1A1F check), and again with smaller weights for bf16 (see BF16_WEIGHT_STD)."""
    fp32 = {n: make_hf_checkpoint(str(root / n), **kw) for n, kw in TINY_CONFIGS.items()}
    bf16 = {
        f"{n}@std{BF16_WEIGHT_STD}": make_hf_checkpoint(str(root / f"{n}-bf16"), weight_std=BF16_WEIGHT_STD, **kw)
        for n, kw in TINY_CONFIGS.items()
    }
    return {"float32": fp32, "bfloat16": bf16}


@functools.cache
def cpu_reference(path: str, steps: int) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """afd.LLM on the CPU in fp32: greedy ids and per-step logits for PROMPTS (EOS ignored: every step counts)."""
    import afd

    logits: list = []
    ids = afd.LLM(path, dtype="float32", block_size=BLOCK_SIZE).generate_ids(
        PROMPTS, steps, ignore_eos=True, logits_out=logits
    )
    return ids, [[x.float().cpu() for x in per] for per in logits]


def _agreeing_prefix(ours: list[int], ref: list[int]) -> int:
    return next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))


def teacher_forced(llm, prompts: list[list[int]], ref_ids: list[list[int]], max_rounds: int = MAX_ROUNDS):
    """The device's greedy token and logits at step k of every prompt, each given the reference's history
    prompt + ref[:k]. Greedy decoding runs on while it agrees with the reference; after a step where it
    picks another token it restarts from the reference's history (one more round), so that one near-tie
    does not turn every later step into a comparison of two different texts. Returns (tokens, logits,
    rounds); a prompt whose lists are shorter than its reference was cut short by max_rounds."""
    steps = len(ref_ids[0])
    tokens: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    rounds = 0
    while rounds < max_rounds:
        todo = [i for i, t in enumerate(tokens) if len(t) < steps]
        if not todo:
            break
        rounds += 1
        got: list = []
        out = llm.generate_ids(
            [prompts[i] + ref_ids[i][: len(tokens[i])] for i in todo],
            [steps - len(tokens[i]) for i in todo],
            ignore_eos=True,
            logits_out=got,
        )
        for i, gen, lg in zip(todo, out, got):
            done = len(tokens[i])
            n = min(len(gen), _agreeing_prefix(gen, ref_ids[i][done:]) + 1)  # through the first disagreement
            tokens[i] += gen[:n]
            logits[i] += [x.float().cpu() for x in lg[:n]]
    return tokens, logits, rounds


@dataclass
class StepCompare:
    where: str
    strict: bool  # the device's token is the reference's
    up_to_tie: bool  # ... or one the reference scores within TIE x max|logit| of its own
    rel_err: float  # max |device - ref| / max |ref| over the vocabulary


def compare_step(
    where: str, token: int, logits: torch.Tensor, ref_token: int, ref_logits: torch.Tensor, tie: float = TIE
) -> StepCompare:
    scale = ref_logits.abs().max().clamp_min(1e-30)
    gap = ((ref_logits[ref_token] - ref_logits[token]) / scale).item()
    err = ((logits - ref_logits).abs().max() / scale).item()
    return StepCompare(where, token == ref_token, token == ref_token or gap <= tie, err)


def quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def judge_colocated(name: str, dtype: str, steps: list[StepCompare], restarts: int, cut_short: list[str]) -> Result:
    """fp32: every token the reference's; bf16: >= MIN_TOP1 of steps up to near-ties. Both: the per-step
    logits errors within LOGITS_TOL[dtype], and every step compared."""
    if not steps:
        return Result(name, "fail", "no step was compared")
    errs = sorted(s.rel_err for s in steps)
    worst = max(steps, key=lambda s: s.rel_err)
    stats = {"max": errs[-1], "p99": quantile(errs, 0.99), "median": quantile(errs, 0.5)}
    strict = sum(s.strict for s in steps) / len(steps)
    tied = sum(s.up_to_tie for s in steps) / len(steps)
    misses = [s.where for s in steps if not s.strict]
    figures = {
        "steps": len(steps),
        "top1_strict": round(strict, 4),
        "top1_up_to_ties": round(tied, 4),
        "restarts": restarts,
        **{f"logits_err_{k}": v for k, v in stats.items()},
        "worst_at": worst.where,
    }
    problems = []
    if cut_short:
        problems.append(f"cut short after {MAX_ROUNDS} rounds of disagreement: {', '.join(cut_short)}")
    if dtype == "float32" and misses:
        problems.append(f"tokens differ at {len(misses)} steps (first: {misses[0]})")
    if dtype != "float32" and tied < MIN_TOP1:
        problems.append(f"top-1 (up to near-ties) agrees on {tied:.1%} of steps < {MIN_TOP1:.0%}")
    bounds = LOGITS_TOL[dtype]
    problems += [f"logits err {k} {stats[k]:.3g} > {bound}" for k, bound in bounds.items() if not stats[k] <= bound]
    if problems:
        return Result(name, "fail", "; ".join(problems), figures)
    held = "identical greedy tokens" if dtype == "float32" else f"top-1 on {tied:.1%} of steps up to near-ties"
    within = ", ".join(f"{k} <= {bound}" for k, bound in bounds.items())
    return Result(name, "pass", f"{held}; logits err {within}", figures)


def check_colocated(target: Target, dtype: str, ckpts: dict[str, str], steps: int) -> Result:
    import afd

    name = f"colocated {dtype} vs CPU fp32"
    ok, why = dtype_supported(target, dtype)
    if not ok:
        return Result(name, "skip", why)
    compared: list[StepCompare] = []
    restarts, cut_short = 0, []
    for label, path in ckpts.items():
        ref_ids, ref_logits = cpu_reference(path, steps)
        llm = afd.LLM(path, dtype=dtype, device=target.kind, block_size=BLOCK_SIZE)
        tokens, logits, rounds = teacher_forced(llm, PROMPTS, ref_ids)
        restarts += rounds - 1
        for i, (toks, lgs) in enumerate(zip(tokens, logits)):
            if len(toks) < steps:
                cut_short.append(f"{label} prompt {i}")
            compared += [
                compare_step(f"{label} prompt {i} step {k}", t, lg, ref_ids[i][k], ref_logits[i][k])
                for k, (t, lg) in enumerate(zip(toks, lgs))
            ]
    return judge_colocated(name, dtype, compared, restarts, cut_short)


# ---------------------------------------------------------------------------------------------------------
# check: grouped GEMM vs the per-expert loop


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
                )
            )
            announce(out[-1])
    return out


# ---------------------------------------------------------------------------------------------------------
# check: 1 attention node + 1 FFN node over NCCL / HCCL, through the OpenAI API


class Launched:
    """`afd launch FILE` as a user runs it, in its own session; stop() sends SIGTERM, as Ctrl-C would."""

    def __init__(self, config: Path, log: Path):
        self.log = log
        with open(log, "w") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "afd.cli", "launch", str(config)],
                cwd=ROOT,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self, url: str, timeout: float) -> None:
        from cluster_helpers import health

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"afd launch exited with {self.proc.returncode} before the API was ready")
            if health(url) == 200:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the cluster was not ready within {timeout:.0f}s")

    def stop(self) -> None:
        from afd.cluster.processes import descendants

        if self.proc.poll() is not None:
            return
        nodes = descendants(self.proc.pid)  # the launcher starts each node in a session of its own
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            for pid in [self.proc.pid, *nodes]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait()

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _cluster_config(tmp: Path, ckpt: str, target: Target) -> tuple[Path, str]:
    """The YAML of a 1A1F cluster on free local ports, and its API's URL."""
    import yaml
    from cluster_helpers import cluster_yaml

    # generous timeouts: a device node creates its context, loads, and forms NCCL/HCCL before it answers
    path = cluster_yaml(
        tmp, ckpt, name="device-1a1f", cluster={"startup_timeout": 180, "heartbeat_timeout": 30, "comm_timeout": 120}
    )
    doc = yaml.safe_load(path.read_text())
    for node in doc["nodes"]:  # attention on device 0, FFN on device 1 (Node.device_type / device_index)
        node["device"] = "cpu" if target.kind == "cpu" else f"{target.kind}:{0 if node['role'] == 'attention' else 1}"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    attention = next(n for n in doc["nodes"] if n["role"] == "attention")
    return path, f"http://127.0.0.1:{attention['ports']['http']}"


def _complete(url: str, prompt: list[int]) -> list[int]:
    from cluster_helpers import post

    status, body = post(
        url,
        "/v1/completions",
        {"prompt": prompt, "max_tokens": API_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True},
        timeout=120,
    )
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {body}")
    return body["choices"][0]["token_ids"]


def check_1a1f(target: Target, ckpt: str, steps: int) -> Result:
    name = f"1A1F over {target.dist.upper()} via the OpenAI API"
    if target.kind != "cpu" and target.count < 2:
        return Result(
            name,
            "skip",
            f"{target.count} {target.kind} device here: 1A1F needs 2 (attention on "
            f"{target.kind}:0, FFN on {target.kind}:1)",
        )
    ok, why = dtype_supported(target, "float32")
    if not ok:
        return Result(name, "skip", f"compared in fp32, which this device refuses: {why}")
    ref = [ids[:API_TOKENS] for ids in cpu_reference(ckpt, max(steps, API_TOKENS))[0]]  # greedy: a prefix
    with tempfile.TemporaryDirectory(prefix="afd-device-1a1f-") as tmp:
        config, url = _cluster_config(Path(tmp), ckpt, target)
        cluster = Launched(config, Path(tmp) / "launch.log")
        try:
            t0 = time.perf_counter()
            cluster.wait_ready(url, CLUSTER_READY_TIMEOUT)
            t1 = time.perf_counter()
            with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: the engine batches them
                got = list(pool.map(lambda p: _complete(url, p), PROMPTS))
            t2 = time.perf_counter()
        except Exception as e:
            say(f"-- afd launch log (last lines)\n{cluster.tail()}")
            return Result(name, "fail", f"{type(e).__name__}: {e}")
        finally:
            cluster.stop()
    figures = {
        "requests": len(PROMPTS),
        "tokens_each": API_TOKENS,
        "ready_s": round(t1 - t0, 1),
        "requests_s": round(t2 - t1, 2),
    }
    wrong = [i for i, (a, b) in enumerate(zip(got, ref)) if a != b]
    if wrong:
        i = wrong[0]
        return Result(
            name,
            "fail",
            f"{len(wrong)} of {len(PROMPTS)} requests differ from CPU fp32 (prompt {i}: {got[i]} vs {ref[i]})",
            figures,
        )
    return Result(name, "pass", f"{len(PROMPTS)} concurrent greedy requests equal CPU fp32 tokens", figures)


# ---------------------------------------------------------------------------------------------------------
# running it


def guarded(fn: Callable[[], Result], name: str) -> Result:
    """One check, timed; an exception is that check's failure, not the end of the run."""
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception as e:
        traceback.print_exc()
        result = Result(name, "fail", f"{type(e).__name__}: {e}")
    result.seconds = round(time.perf_counter() - t0, 2)
    return result


def announce(result: Result) -> Result:
    say(f"[{result.status}] {result.check}: {result.reason}")
    return result


# What the table lists when there is no accelerator: one skipped row per device check.
SKIPPED_WITHOUT_DEVICE = {
    "colocated": ["colocated float32 vs CPU fp32", "colocated bfloat16 vs CPU fp32"],
    "gemm": ["grouped GEMM vs the per-expert loop"],
    "1a1f": ["1A1F over NCCL / HCCL"],
}


def run_device_checks(args, target: Target) -> list[Result]:
    steps = 8 if args.quick else STEPS
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="afd-device-ckpt-") as root:
        ckpts = {}
        if {"colocated", "1a1f"} & set(args.checks):
            say("== building the tests' tiny random checkpoints (transformers; nothing is downloaded)")
            ckpts = build_checkpoints(Path(root))
        if "colocated" in args.checks:
            for dtype in ("float32", "bfloat16"):
                say(f"== colocated {dtype} on {target.kind} vs CPU fp32")
                name = f"colocated {dtype} vs CPU fp32"
                results.append(announce(guarded(lambda d=dtype: check_colocated(target, d, ckpts[d], steps), name)))
        if "gemm" in args.checks:
            say(f"== grouped GEMM on {target.kind} vs the per-expert loop")
            try:
                results += check_gemm(target, args.quick)
            except Exception as e:  # the backend itself failed to start
                traceback.print_exc()
                results.append(announce(Result("grouped GEMM", "fail", f"{type(e).__name__}: {e}")))
        if "1a1f" in args.checks:
            say(f"== 1A1F over {target.dist}")
            ckpt = ckpts["float32"]["zero_experts"]
            results.append(announce(guarded(lambda: check_1a1f(target, ckpt, steps), "1A1F")))
    return results


def run_checks(args, target: Target | None, why: str) -> list[Result]:
    results = []
    if "pytest" in args.checks:
        say("== device tests (pytest)")
        results.append(announce(guarded(check_pytest, "device tests (pytest)")))
    if target is None:
        return results + [
            announce(Result(n, "skip", f"no accelerator: {why}"))
            for c in CHECKS
            if c in args.checks
            for n in SKIPPED_WITHOUT_DEVICE.get(c, [])
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
