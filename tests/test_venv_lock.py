"""The lock (requirements.txt): it covers what pyproject.toml asks for, pins each package with hashes, and is
what this environment has installed (tests/venv_lock.py; `make setup` syncs the venv to it)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from venv_lock import LOCK, ROOT, canonical, differences, installed, read_lock

STAMP = Path(sys.prefix) / ".afd-installed"  # the Makefile's: this venv was made by `make setup`


def pyproject_requirements() -> list[Requirement]:
    """The runtime dependencies and the extras `make setup` installs (test, fuzz)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in (*project["dependencies"], *extras["test"], *extras["fuzz"])]


def test_the_lock_pins_every_requirement_at_a_version_its_range_admits():
    """A dependency added to pyproject.toml without `make lock` fails here, not on a fresh clone."""
    lock = read_lock()
    for req in pyproject_requirements():
        name = canonical(req.name)
        assert name in lock, f"{req} is in pyproject.toml but not in {LOCK.name}: run make lock"
        assert req.specifier.contains(lock[name], prereleases=True), f"{LOCK.name} pins {name}=={lock[name]}: {req}"


def test_every_pin_has_a_hash_and_torch_is_the_cpu_build():
    text = LOCK.read_text()
    blocks = re.split(r"\n(?=[A-Za-z0-9])", text)  # a pin's block: its line, its hashes, pip-compile's "via"
    pins = [b for b in blocks if "==" in b.split("\n", 1)[0]]
    assert len(pins) == len(read_lock())
    for b in pins:
        assert "--hash=sha256:" in b, b.split("\n", 1)[0]
    assert read_lock()["torch"].endswith("+cpu")  # PyPI's Linux torch is a CUDA build of several GB


def test_differences_name_what_is_missing_changed_or_extra():
    lock = {"pyyaml": "6.0.2", "torch": "2.13.0+cpu", "numpy": "2.4.6"}
    have = {"pyyaml": "6.0.2", "torch": "2.13.0", "requests": "2.32.0", "afd": "0.1.0"}
    assert differences(lock, have) == (
        ["numpy==2.4.6"],
        ["torch: 2.13.0 here, 2.13.0+cpu in the lock"],
        ["requests==2.32.0"],  # afd itself is installed from the tree, in no lock
    )
    assert canonical("PyYAML") == "pyyaml" and canonical("typing_extensions") == canonical("Typing.Extensions")


def test_this_environment_is_the_lock():
    """`make setup` installs the lock and removes what it does not name: pip freeze is the lock, afd aside."""
    if not STAMP.is_file():
        pytest.skip(f"{sys.prefix} was not made by `make setup` from the lock (make test-latest's venv, or another)")
    missing, changed, extra = differences(read_lock(), installed())
    assert (missing, changed, extra) == ([], [], []), "make clean setup rebuilds the venv from the lock"
