"""Running afd's node processes on the fake Ascend device (tests/fakes): the environment, each process's
report, devices for a cluster YAML, and the bound of one host sync per step read from the reports."""

from __future__ import annotations

import glob
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import yaml
from cluster_helpers import Cluster, get, post
from hf_reference import PROMPTS
from metrics_text import total

FAKES = str(Path(__file__).parent / "fakes")

Snapshot = Callable[[], tuple[dict[str, dict[str, int]], dict[str, float]]]
"""Per node process (by name: attn0, attn0.tp1, ffn0, ...) its host syncs by site so far, and per node its
afd_host_syncs_total, taken at one moment."""

SAMPLED = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 3, "presence_penalty": 0.5, "logprobs": 2}
"""Every kind of sampling field the device batch handles, in one request."""


def fake_env(report: Path) -> dict:
    return {
        "PYTHONPATH": os.pathsep.join([FAKES, os.environ.get("PYTHONPATH", "")]),
        "AFD_FAKE_NPU_REPORT": str(report),
    }


def sync_env(report: Path) -> dict:
    """fake_env, with host syncs counted per site and reports rewritten every 0.05 s (compared with a scrape)."""
    return {**fake_env(report), "AFD_FAKE_NPU_SYNC_SITES": "1", "AFD_FAKE_NPU_REPORT_S": "0.05"}


def reports(report: Path) -> dict[str, dict]:
    """Each process's report (written as `{report}.{pid}.json`), by file."""
    return {f: json.loads(Path(f).read_text()) for f in sorted(glob.glob(f"{report}.*.json"))}


def report_pid(file: str) -> int:
    return int(file.rsplit(".", 2)[-2])


def on_devices(path: Path) -> None:
    """Node i on the next free device from npu:1; an attention node's TP rank r on its device + r."""
    doc = yaml.safe_load(path.read_text())
    tp = (doc.get("layout") or {}).get("attention_tp", 1)
    free = 1
    for node in doc["nodes"]:
        node["device"] = f"npu:{free}"
        free += tp if node["role"] == "attention" else 1
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def snapshot(report: Path, c: Cluster) -> Snapshot:
    """Each node process's host syncs by site (the fake's report), and each node's afd_host_syncs_total."""
    urls = {
        n["name"]: c.url(n["name"]) if n["role"] == "attention" else f"http://127.0.0.1:{n['ports']['metrics']}"
        for n in c.doc["nodes"]
    }

    def take():
        counted = {n: total(get(u, "/metrics")[1].decode(), "afd_host_syncs_total") for n, u in urls.items()}
        names = {p.pid: name for name, p in c.procs.items()}
        sites = {names[report_pid(f)]: r["device"]["host_sync_sites"] for f, r in reports(report).items()}
        return sites, counted

    return take


def check_one_host_sync_per_step(url: str, snapshot: Snapshot, roles: dict[str, str]) -> None:
    """The bound of one host sync per step: the attention node at `url` (attn0) learns its sampled tokens once
    per step (a greedy request, then one with temperature, top-k/top-p, a seed, a penalty and logprobs) and the
    FFN node reads its step header once; nothing else on the hot path waits for the device (exchange waits are
    stream-ordered, copies to the device are staged in pinned memory, the FFN times its compute with events).
    Idle steps (an attention node with nothing to run) each cost one read on both sides and are taken out. The
    nodes write their reports on their own clocks, so the FFN nodes' idle steps are not the attention node's
    count: there, every sync must be a step header's read, one per step, idle or not. Another attention node,
    idle, syncs only in its idle steps; a TP rank > 0, which samples nothing, at most once per step too. roles:
    node name -> attention or ffn."""
    n = 10
    greedy = {"prompt": PROMPTS[0], "max_tokens": n, "temperature": 0, "ignore_eos": True}
    time.sleep(1.0)  # the idle steps after warm-up, whose counts the reports and the scrape catch up with
    before, counted0 = snapshot()
    for body in (greedy, {**greedy, **SAMPLED}):
        code, out = post(url, "/v1/completions", body)
        assert code == 200, out
        assert "logprobs" not in body or len(out["choices"][0]["logprobs"]["token_logprobs"]) == n, out
    time.sleep(1.0)
    after, counted1 = snapshot()
    delta = {
        name: {k: v - before.get(name, {}).get(k, 0) for k, v in a.items() if v - before.get(name, {}).get(k, 0)}
        for name, a in after.items()
    }
    steps = 2 * n  # per request, one prefill step and n - 1 decode steps
    scrape = " in read at backend/counters.py"  # a scrape's read of the expert counts, not a step's
    # layout.routing attention (more than one FFN node): each (layer, micro-batch)'s row counts are read once on
    # each side, the sizes of its messages (afd/dataplane/dispatch.py; docs/architecture/dataplane.md)
    counts = ("dataplane/dispatch.py", "_read_counts")
    for name, d in delta.items():
        node, _, rank = name.partition(".")
        idle = sum(v for k, v in d.items() if " in idle " in k)
        d = {k: v for k, v in d.items() if not any(c in k for c in counts)}
        if roles[node] == "ffn":
            assert all(" in _recv_headers at ffn_node/server.py" in k or scrape in k for k in d), (name, d)
        elif node == "attn0":
            # the leader reads only its sampled tokens (MTP drafts included: they stay on the device)
            assert rank or all(" at engine/sampling.py:" in k or " in idle " in k for k in d), (name, d)
            assert rank or any(" at engine/sampling.py:" in k for k in d), (name, d)
            assert sum(d.values()) - idle <= steps, (name, d)
        else:
            assert sum(d.values()) == idle, (name, d)  # nothing ran there
    # afd_host_syncs_total counts what the fake saw. Slack: the fake's report may be 0.05 s older than the
    # scrape, and idle steps (one sync each on both nodes) run back to back between requests.
    for name in counted1:
        counted = counted1[name] - counted0[name]
        assert abs(counted - sum(delta.get(name, {}).values())) <= 6, (name, counted, delta.get(name))
    assert counted1["attn0"] - counted0["attn0"] >= steps, (counted1, counted0)
