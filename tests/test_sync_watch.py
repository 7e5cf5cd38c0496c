"""afd/backend/sync_watch.py: the device runtime's own count of host syncs (its sync debug mode), independent of
afd's counter, on the fake NPU, whose synchronizing operations warn as torch_npu's do under
`torch.npu.set_sync_debug_mode("warn")`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from cluster_helpers import ROOT

FAKES = ROOT / "tests" / "fakes"
_RUN = r"""
import json, sys, warnings
sys.path.insert(0, sys.argv[1])
import torch, torch_npu
from afd.backend.npu import NpuBackend
backend = NpuBackend(0)  # installs the watch: AFD_SYNC_WATCH is set
warnings.warn("an unrelated warning", UserWarning)  # still shown as before
x = torch.ones(4, device="npu:0")
before = torch.npu.STATS["host_syncs"]
x.sum().item()  # an implicit read nobody counted: the runtime sees it
backend.synchronize()
torch.npu.synchronize()
print(json.dumps({"fake": torch.npu.STATS["host_syncs"] - before, "total": torch.npu.STATS["host_syncs"],
                  "mode": torch.npu.get_sync_debug_mode()}))
"""


def test_the_watch_counts_what_the_runtime_calls_synchronizing_by_afds_line(tmp_path):
    prefix = tmp_path / "watch"
    env = {**os.environ, "AFD_SYNC_WATCH": str(prefix)}
    out = subprocess.run(
        [sys.executable, "-c", _RUN, str(FAKES)], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "an unrelated warning" in out.stderr and "called a synchronizing" not in out.stderr
    (file,) = list(tmp_path.glob("watch.*.json"))
    watch = json.loads(file.read_text())
    assert got["mode"] == 1 and got["fake"] == 3
    assert watch["count"] == got["total"], (watch, got)  # every sync the device made, none missed, none twice
    assert any(site.startswith("synchronize at backend/npu.py:") for site in watch["first"]), watch
    assert watch["first"] == list(watch["sites"])[:10]


def test_without_the_variable_nothing_changes():
    from afd.backend import sync_watch

    assert sync_watch.from_env(lambda mode: (_ for _ in ()).throw(AssertionError(mode))) is None
