"""`make test-device`'s environment: the torch a device machine already has, when it can run afd, with nothing
installed over it; then tests/device/check.py on it.

    python3 tests/device/device_venv.py [--wheels DIR] [--dry-run] [--venv DIR] [--cpu-venv DIR] -- [check.py args]

1. It asks the machine's interpreter (`make`'s PY) which torch it has: its version, whether CUDA is usable
   (`torch.cuda.is_available()`), whether torch_npu imports and sees an NPU.
2. A device torch within afd's range (pyproject.toml): a venv (`--venv`, .venv-device/) made with
   `--system-site-packages`, so that it sees that torch, torch_npu and CANN's Python parts as installed. Into
   it goes only what the lock (requirements.txt) names and the machine lacks, or has outside afd's own ranges,
   at the lock's version and hashes, never a device package (torch, torch_npu, torchair, triton, nvidia-*): the
   device stack stays as the machine had it. It says which packages, then installs them from the index, or from
   `--wheels DIR` (`make test-device WHEELS=DIR`) with no index at all.
3. No device torch: the CPU venv of `make setup` (`--cpu-venv`, the lock's CPU torch). check.py then says that
   this machine has an accelerator torch cannot use (exit 2), or runs its dry run with `--device cpu`.
4. check.py runs with the venv's interpreter and the arguments after `--`.

`--dry-run` says all of it, and installs and runs nothing. Standard library only: it runs before any venv.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements.txt"
DEVICE_PACKAGES = re.compile(r"^(torch|torch-npu|torchair|triton|nvidia-.*)$")
"""What a device machine's own stack is made of: never installed or replaced here."""

PROBE = r"""
import json, sys
out = {"python": "%d.%d" % sys.version_info[:2], "torch": None, "device": None, "why": ""}
try:
    import torch
    out["torch"] = torch.__version__
    try:
        import torch_npu  # noqa: F401
        if torch.npu.is_available():
            out["device"] = "npu"
    except Exception as e:
        out["why"] = f"torch_npu: {type(e).__name__}: {e}; "
    if out["device"] is None and torch.cuda.is_available():
        out["device"] = "cuda"
    if out["device"] is None:
        out["why"] += f"torch {torch.__version__} sees no GPU or NPU (CUDA {torch.version.cuda})"
except Exception as e:
    out["why"] = f"no torch ({type(e).__name__}: {e})"
try:
    from importlib.metadata import distributions
    out["installed"] = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in distributions()}
except Exception:
    out["installed"] = {}
print(json.dumps(out))
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_entries(text: str) -> dict[str, tuple[str, str]]:
    """requirements.txt's packages: name -> (version, its whole entry, hashes included)."""
    out = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", text):
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", block)
        if m:
            entry = "\n".join(line for line in block.splitlines() if not line.strip().startswith("#"))
            out[canonical(m.group(1))] = (m.group(2), entry.strip())
    return out


def afd_ranges(pyproject: str) -> dict[str, str]:
    """The packages afd names itself (its dependencies and the test extra check.py uses) -> their specifiers."""
    doc = tomllib.loads(pyproject)["project"]
    reqs = [*doc["dependencies"], *doc.get("optional-dependencies", {}).get("test", [])]
    out = {}
    for r in reqs:
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*([^;]*)", r)
        if m:
            out[canonical(m.group(1))] = m.group(2).strip()
    return out


def satisfies(version: str, spec: str) -> bool:
    """Whether `version` meets `spec` (PEP 440), with pip's own packaging."""
    if not spec:
        return True
    from pip._vendor.packaging.specifiers import SpecifierSet

    return SpecifierSet(spec).contains(version, prereleases=True)


@dataclass
class Plan:
    venv: str
    """Which venv check.py runs in: "device" (the machine's torch) or "cpu" (make setup's)."""
    why: str
    needed: list[str] = field(default_factory=list)
    """Lock entries to install into the device venv."""
    notes: list[str] = field(default_factory=list)


def plan(probe: dict, lock: dict[str, tuple[str, str]], ranges: dict[str, str]) -> Plan:
    torch_version = probe.get("torch")
    if not probe.get("device"):
        return Plan("cpu", f"no device torch on this interpreter: {probe.get('why') or 'none found'}")
    base = (torch_version or "").split("+")[0]
    if not satisfies(base, ranges.get("torch", "")):
        return Plan("cpu", f"torch {torch_version} is outside afd's range torch{ranges['torch']}: it cannot run afd")
    if probe.get("python") != "3.11":
        note = f"python {probe.get('python')}: the lock is for 3.11, so pip may find no wheel for some entries"
    else:
        note = ""
    out = Plan("device", f"{probe['device']} on torch {torch_version}: used as installed", notes=[note] if note else [])
    installed = {canonical(k): v for k, v in probe.get("installed", {}).items()}
    for name, (version, entry) in sorted(lock.items()):
        if DEVICE_PACKAGES.match(name):
            continue
        have = installed.get(name)
        if have is None:
            out.needed.append(entry)
        elif name in ranges and not satisfies(have, ranges[name]):
            out.needed.append(entry)
            out.notes.append(f"{name} {have} is outside afd's range {ranges[name]}: the venv takes {version}")
    return out


def run(cmd: list[str], dry: bool) -> None:
    print("+ " + " ".join(cmd), flush=True)
    if not dry:
        subprocess.run(cmd, check=True)


def main(argv: list[str]) -> int:
    ours, _, theirs = (argv[: argv.index("--")], None, argv[argv.index("--") + 1 :]) if "--" in argv else (argv, 0, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", default=str(ROOT / ".venv-device"))
    p.add_argument("--cpu-venv", default=str(ROOT / ".venv"))
    p.add_argument("--wheels", help="a folder of the needed wheels, for a machine that reaches no index")
    p.add_argument("--dry-run", action="store_true", help="say what it would do; install and run nothing")
    args = p.parse_args(ours)
    probe = json.loads(subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True).stdout)
    lock = lock_entries(LOCK.read_text())
    the_plan = plan(probe, lock, afd_ranges((ROOT / "pyproject.toml").read_text()))
    print(f"test-device: {sys.executable}: {the_plan.why}", flush=True)
    for note in the_plan.notes:
        print(f"test-device: note: {note}", flush=True)
    if the_plan.venv == "cpu":
        python = Path(args.cpu_venv) / "bin" / "python"
        print(f"test-device: check.py runs in make setup's venv, {args.cpu_venv} (the lock's CPU torch)", flush=True)
        if not python.exists():
            run(["make", "-C", str(ROOT), "setup"], args.dry_run)
    else:
        python = Path(args.venv) / "bin" / "python"
        if not python.exists():
            run([sys.executable, "-m", "venv", "--system-site-packages", args.venv], args.dry_run)
        names = [entry.split("==")[0] for entry in the_plan.needed]
        print(f"test-device: {len(names)} package(s) from the lock this machine lacks: {', '.join(names) or 'none'}")
        if the_plan.needed:
            need = Path(args.venv) / "needed.txt"
            if not args.dry_run:
                need.write_text("\n".join(the_plan.needed) + "\n")
            where = ["--no-index", "--find-links", args.wheels] if args.wheels else []
            print(
                f"test-device: without an index, download them where one is reachable "
                f"(pip download --no-deps --require-hashes -r {need} -d DIR) and run make test-device WHEELS=DIR",
                flush=True,
            )
            pip = [str(python), "-m", "pip", "install", "--no-deps"]
            run([*pip, "--require-hashes", *where, "-r", str(need)], args.dry_run)
        editable = ["--quiet", "--no-deps", "--no-build-isolation", "-e", str(ROOT)]
        run([str(python), "-m", "pip", "install", *editable], args.dry_run)
    check = [str(python), str(ROOT / "tests" / "device" / "check.py"), *theirs]
    if args.dry_run:
        print("+ " + " ".join(check))
        return 0
    os.execv(check[0], check)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
