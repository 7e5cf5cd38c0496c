"""Running a script as the ranks of a fake-HCCL group (tests/fakes), for test_fake_hccl_failures.py and
test_fake_hccl_dataplane.py. The fake's hang is 20 s (AFD_FAKE_HANG_S) whatever the caller's environment says,
unless a case asks for another.
"""

from __future__ import annotations

import os
from pathlib import Path

from rank_processes import run_ranks

FAKES = str(Path(__file__).parent / "fakes")


def _run(code: str, ranks: int, timeout: float = 90, **env) -> list[str]:
    """Runs `code` as `ranks` processes (argv[1] = the rank); returns each one's output."""
    return [r.output for r in run_ranks(code, ranks, timeout, {**os.environ, "AFD_FAKE_HANG_S": "20", **env})]
