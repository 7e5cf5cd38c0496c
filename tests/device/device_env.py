"""The machine `make test-device` runs on: which accelerator torch can use (find_target), which ones the
machine has whether torch can use them or not (visible_accelerators, unusable_accelerator), the environment
the report records, and whether the device computes in a dtype."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from collections.abc import Callable

import torch
from device_common import ROOT, Target, say


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
                f"({shown}): install a CUDA build of torch (see the Makefile's PIP_LOCK_ARGS)"
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
