"""Check `pytest`: the device-guarded tests (DEVICE_TESTS), run by pytest; skips keep pytest's reasons."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from device_common import ROOT, say
from device_report import Result

# The device-guarded tests (a skipif on the device or its SDK). Add new ones here.
DEVICE_TESTS = (
    "tests/test_cuda.py",
    "tests/test_graph_cuda.py",
    "tests/test_cuda_quant.py",
    "tests/test_backend_and_sampling.py::test_cuda_grouped_matmul",
    "tests/test_backend_and_sampling.py::test_npu_backend_fails_clearly_without_torch_npu",
    "tests/test_prefetch.py::test_npu_prefetch_for_real",
    "tests/test_prefetch.py::test_npu_prefetch_spec_and_an_expert_slice_for_real",
)
PYTEST_TIMEOUT = 300
MEASURED = "the device-guarded tests' verdicts, by pytest"


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
