"""The running environment held against requirements.txt, the lock that `make setup` installs from.

`make setup` installs the lock with pip (hashes required), then runs `python tests/venv_lock.py --sync`:
a package the lock does not name (left from an older lock, or installed by hand) is uninstalled, and a
version that differs from the lock fails setup. So the venv is the lock, exactly: `pip freeze` lists the
lock's pins and afd itself (editable), nothing else. tests/test_venv_lock.py checks the same from the suite.
`make test-latest` runs `--compare` in its own venv: it prints which releases there differ from the lock,
which names the upstream change when the newest releases fail where the lock passes.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.utils import canonicalize_name as canonical  # PEP 503: `PyYAML` and `pyyaml` are one package

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.txt"
# The project itself: installed editable from the work tree, so it is in no lock.
PROJECT = "afd"
# The venv's own tools, present in every venv before the lock is installed; the lock pins them too (pip-tools
# needs them), but pip may not uninstall itself, so they are compared, never removed.
NEVER_REMOVED = {"pip", "setuptools", "wheel"}

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")


def read_lock(path: Path = LOCK) -> dict[str, str]:
    """{package: version} of every `name==version` line of a pip-compile output."""
    pins = {}
    for line in path.read_text().splitlines():
        m = _PIN.match(line)
        if m:
            pins[canonical(m.group(1))] = m.group(2)
    if not pins:
        raise SystemExit(f"{path}: no `name==version` line; is it pip-compile's output (make lock)?")
    return pins


def installed() -> dict[str, str]:
    """{package: version} of what this interpreter's environment has installed."""
    found = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found[canonical(name)] = dist.version
    return found


def differences(lock: dict[str, str], have: dict[str, str]) -> tuple[list[str], list[str], list[str]]:
    """(missing, changed, extra): lines naming what the environment lacks, has at another version, or has
    beyond the lock."""
    missing = [f"{n}=={v}" for n, v in sorted(lock.items()) if n not in have]
    changed = [f"{n}: {have[n]} here, {v} in the lock" for n, v in sorted(lock.items()) if n in have and have[n] != v]
    extra = [f"{n}=={v}" for n, v in sorted(have.items()) if n not in lock and n != PROJECT]
    return missing, changed, extra


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--sync", action="store_true", help="uninstall what the lock does not name, then check")
    mode.add_argument("--compare", action="store_true", help="print how the environment differs; exit 0")
    ap.add_argument("--lock", type=Path, default=LOCK)
    args = ap.parse_args(argv)
    lock, have = read_lock(args.lock), installed()
    missing, changed, extra = differences(lock, have)
    if args.compare:
        print(f"against {args.lock.name}: {len(changed)} changed, {len(extra)} not in it, {len(missing)} absent")
        for line in changed:
            print(f"  changed  {line}")
        for line in extra:
            print(f"  extra    {line}")
        for line in missing:
            print(f"  absent   {line}")
        return 0
    if args.sync:
        removable = [n for n in have if n not in lock and n != PROJECT and n not in NEVER_REMOVED]
        if removable:
            print(f"removing what {args.lock.name} does not name: {' '.join(removable)}")
            subprocess.run([sys.executable, "-m", "pip", "uninstall", "--yes", "--quiet", *removable], check=True)
            missing, changed, extra = differences(lock, installed())
    problems = [f"absent: {m}" for m in missing] + [f"changed: {c}" for c in changed]
    problems += [f"not in the lock: {e}" for e in extra]
    if problems:
        print(f"{sys.prefix} is not {args.lock.name} (make clean setup rebuilds it):", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        return 1
    print(f"{sys.prefix}: {len(lock)} packages, each at the lock's version")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
