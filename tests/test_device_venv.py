"""tests/device/device_venv.py: `make test-device` takes a device machine's torch as installed and adds only what
the lock names and the machine lacks; without a device torch it runs in make setup's CPU venv."""

from __future__ import annotations

import subprocess
import sys

from cluster_helpers import ROOT

sys.path.insert(0, str(ROOT / "tests" / "device"))
import device_venv  # noqa: E402

LOCK = device_venv.lock_entries((ROOT / "requirements.txt").read_text())
RANGES = device_venv.afd_ranges((ROOT / "pyproject.toml").read_text())


def _probe(torch="2.9.0+cu128", device="cuda", **installed) -> dict:
    have = {name: version for name, (version, _) in LOCK.items()}  # a machine with everything at the lock's
    have.update({"torch": torch.split("+")[0], "nvidia-nccl-cu12": "2.27.5", "sympy": "1.13.1"})
    for name, version in installed.items():
        if version is None:
            have.pop(name.replace("_", "-"), None)
        else:
            have[name.replace("_", "-")] = version
    return {"python": "3.11", "torch": torch, "device": device, "why": "", "installed": have}


def test_the_lock_and_ranges_are_read():
    version, entry = LOCK["transformers"]
    assert entry.startswith(f"transformers=={version}") and "--hash=sha256:" in entry
    assert "torch" in LOCK and RANGES["torch"].startswith(">=") and "transformers" in RANGES


def test_a_device_torch_is_used_as_installed_and_only_what_is_missing_is_added():
    plan = device_venv.plan(_probe(transformers=None, fastapi="0.1.0"), LOCK, RANGES)
    assert plan.venv == "device" and "cuda on torch 2.9.0+cu128" in plan.why
    names = [e.split("==")[0] for e in plan.needed]
    assert "transformers" in names  # absent
    assert ("fastapi" in names) == (not device_venv.satisfies("0.1.0", RANGES.get("fastapi", "")))
    # the device stack and what it brought stay as they are: torch, its CUDA libraries, its sympy
    assert not [n for n in names if device_venv.DEVICE_PACKAGES.match(n) or n == "sympy"]
    assert device_venv.plan(_probe(), LOCK, RANGES).needed == []


def test_without_a_device_torch_or_with_one_afd_cannot_run_the_cpu_venv_is_used():
    assert device_venv.plan({"torch": None, "device": None, "why": "no torch"}, LOCK, RANGES).venv == "cpu"
    cpu_only = device_venv.plan(_probe(torch="2.13.0+cpu", device=None), LOCK, RANGES)
    assert cpu_only.venv == "cpu"
    old = device_venv.plan(_probe(torch="2.1.0+cu121"), LOCK, RANGES)
    assert old.venv == "cpu" and "outside afd's range" in old.why


def test_the_dry_run_installs_and_runs_nothing():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "device" / "device_venv.py"), "--dry-run", "--", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1].endswith("check.py --device cpu")
