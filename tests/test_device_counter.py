"""afd/backend/counters.py on the fake NPU: the metrics scrape reads the FFN node's device counters on a stream of its
own, never waiting for the compute queued on the default stream, and neither the read nor the
next add races the other (the fake raises on an unordered read or overwrite)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from cluster_helpers import ROOT

FAKES = ROOT / "tests" / "fakes"
_RUN = r"""
import json, sys, threading
sys.path.insert(0, sys.argv[1])
import torch, torch_npu
from afd.observability.ffn_metrics import FFNMetrics
from metrics_text import samples

torch.npu.set_device(0)
metrics = FFNMetrics("ffn0", "m", [4, 5, 6], num_layers=1)
out = {}

def scrape(key):
    got = samples(metrics.render().decode())
    waits = dict(torch.npu.STATS["host_waits"])
    out[key] = {
        "experts": {dict(k)["expert"]: v for k, v in got["afd_expert_tokens_total"].items()},
        "zero": sum(got["afd_zero_expert_tokens_total"].values()),
        "waits": waits,
    }
    torch.npu.STATS["host_waits"].clear()

def in_thread(key):
    t = threading.Thread(target=scrape, args=(key,), name="scrape")
    t.start()
    t.join()

class Experts:
    last_counts = torch.tensor([1, 2, 3], device="npu:0")
    last_zero = torch.tensor(5, device="npu:0")

x = torch.ones(64, 64, device="npu:0")
torch.npu.STATS["host_waits"].clear()
metrics.add_routed(Experts)
y = x @ x  # compute queued after the counts: a read on the default stream waits for it
in_thread("first")
metrics.add_routed(Experts)  # after the scrape's copy: ordered after it on the device, or a hazard
y = y @ x
in_thread("second")
out["hazards"] = torch.npu.STATS["hazards"]
out["unbound"] = torch.npu.STATS["unbound"]
print(json.dumps(out))
"""


def test_the_scrape_reads_the_ffn_counters_on_its_own_stream_after_the_last_add(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKES), str(ROOT / "tests")])}
    out = subprocess.run(
        [sys.executable, "-c", _RUN, str(FAKES)], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["first"]["experts"] == {"4": 1, "5": 2, "6": 3} and got["first"]["zero"] == 5
    assert got["second"]["experts"] == {"4": 2, "5": 4, "6": 6} and got["second"]["zero"] == 10
    for key in ("first", "second"):
        waits = got[key]["waits"]
        assert waits and not any("default stream" in s for s in waits), f"the {key} scrape waited for {waits}"
    assert got["hazards"] == [] and got["unbound"] == []
