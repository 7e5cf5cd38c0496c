"""Running the `afd` CLI as a user does, for the cluster YAML tests (test_cluster_config*.py): one call in
its own process, or many calls in one process (each process spends a second importing torch).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def afd(*argv: str) -> subprocess.CompletedProcess:
    """`afd ARGV...` as a user runs it (python -m, so that it is this checkout's afd)."""
    return subprocess.run([sys.executable, "-m", "afd", *argv], capture_output=True, text=True, cwd=ROOT, timeout=180)


def afd_many(argvs: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess]:
    """`afd ARGV...` for each key: afd.entrypoints.cli.main called in turn inside one process, each call's exit code
    and output captured (a process per call spent a second each importing torch). An exception that
    main() lets through fails the whole process, so it cannot pass unnoticed."""
    r = subprocess.run(
        [sys.executable, "-c", _MAIN_MANY, json.dumps(argvs)], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return {
        k: subprocess.CompletedProcess(argvs[k], code, out, err)
        for k, (code, out, err) in json.loads(r.stdout.splitlines()[-1]).items()
    }


_MAIN_MANY = """
import contextlib, io, json, sys
from afd.entrypoints.cli import main
results = {}
for key, argv in json.loads(sys.argv[1]).items():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    results[key] = [code, out.getvalue(), err.getvalue()]
print(json.dumps(results))
"""
