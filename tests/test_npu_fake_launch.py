"""`afd launch` of a cluster YAML whose nodes sit on `device: npu:N`, with tests/fakes on PYTHONPATH: the
launcher checks the devices and starts every node on the fake Ascend device, as on an Ascend host. The fake's
reports then hold the bound for the launched cluster: one host sync per decode step on every node, no
hazard, every thread bound; and SIGTERM stops it cleanly."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

import pytest
import yaml
from cluster_helpers import cluster_yaml, get, post, stop_launcher
from hf_reference import PROMPTS
from metrics_text import total
from npu_fake import check_one_host_sync_per_step, on_devices, report_pid, reports, sync_env

from afd.cluster.processes import Command, NodeProcesses, descendants

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # about 40 s: start-up, two requests, drain
ROOT = Path(__file__).parent.parent
NEW = 12


def _node_name(pid: int) -> str | None:
    """attn0, attn0.tp1, ffn0 ... from a node process's command line; None for any other process."""
    with contextlib.suppress(OSError):
        args = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
        if "--node" in args:
            name = args[args.index("--node") + 1]
            return f"{name}.tp{args[args.index('--tp-rank') + 1]}" if "--tp-rank" in args else name
    return None


def test_a_launched_cluster_on_the_fake_npu_syncs_once_per_step(tiny_checkpoint, families, tmp_path):
    path = cluster_yaml(tmp_path, tiny_checkpoint, 1, 1, name="npu-launch", layout={"micro_batches": 2})
    on_devices(path)
    doc = yaml.safe_load(path.read_text())
    assert [n["device"] for n in doc["nodes"]] == ["npu:1", "npu:2"]
    report = tmp_path / "fake-npu"
    watch = tmp_path / "sync-watch"  # the runtime's own count (afd/backend/sync_watch.py), beside afd's
    env = {**os.environ, **sync_env(report), "AFD_SYNC_WATCH": str(watch)}
    procs = NodeProcesses(str(tmp_path), env=env, cwd=ROOT)
    launcher = procs.start(Command("afd-launch", (sys.executable, "-m", "afd", "launch", str(path))))
    try:

        def url_line() -> list[str]:
            return [line for line in procs.log("afd-launch").splitlines() if line.startswith("http://")]

        procs.wait_until(url_line, 120, "afd launch to print its URL")
        url = url_line()[0].split()[0]
        nodes = {pid: name for pid in descendants(launcher.pid) if (name := _node_name(pid))}
        assert sorted(nodes.values()) == ["attn0", "ffn0"], nodes
        code, body = post(
            url,
            "/v1/completions",
            {"prompt": PROMPTS[0], "max_tokens": NEW, "temperature": 0, "return_token_ids": True},
        )
        assert code == 200, body
        assert body["choices"][0]["token_ids"] == families.ref_ids("longcat_flash", "zero_experts", NEW)[0]
        metrics = {
            n["name"]: url if n["role"] == "attention" else f"http://127.0.0.1:{n['ports']['metrics']}"
            for n in doc["nodes"]
        }

        def snapshot():
            counted = {n: total(get(u, "/metrics")[1].decode(), "afd_host_syncs_total") for n, u in metrics.items()}
            found = reports(report).items()
            return {
                nodes[report_pid(f)]: r["device"]["host_sync_sites"] for f, r in found if report_pid(f) in nodes
            }, counted

        check_one_host_sync_per_step(url, snapshot, {n["name"]: n["role"] for n in doc["nodes"]})
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(90) == 0, procs.log("afd-launch")
    finally:
        stop_launcher(launcher, procs)
    watched = {report_pid(f): r for f, r in reports(watch).items()}
    assert set(nodes) <= set(watched), "every node's runtime counted its syncs"
    for pid, name in nodes.items():  # the step's one read: the FFN node's headers, the attention node's tokens
        sites = watched[pid]["sites"]
        if name == "ffn0":
            assert "_recv_headers at ffn_node/server.py:" in max(sites, key=sites.get), (name, sites)
        else:
            assert any(" at engine/sampling.py:" in site for site in sites), (name, sites)
        assert watched[pid]["argv"][watched[pid]["argv"].index("--node") + 1] == name
    seen = {report_pid(f): r for f, r in reports(report).items()}
    assert set(nodes) <= set(seen), "every node ran on the fake device and wrote its report"
    for pid, name in nodes.items():
        r = seen[pid]
        assert r["device"]["ops"] > 0, name
        assert r["device"]["hazards"] == [] and r["device"]["unbound"] == [], (name, r["device"])
        assert r["hccl"]["send_behind_recv"] == 0 and r["hccl"]["sends"] > 0, (name, r["hccl"])
