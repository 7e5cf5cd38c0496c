"""AFD decode through NpuBackend on the fake Ascend device (tests/fakes/torch_npu): real node processes,
HCCL played by gloo, every device rule of the fake checked as the nodes run, tokens compared with HF.

Nodes sit on devices other than 0 (attention on npu:1, FFN nodes on npu:2..), so a thread that forgets
to bind its node's device acts on the wrong one, as it would on a real machine. Each node's fake
writes what it saw (hazards, unbound threads, sends queued behind receives) when it exits.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from cluster_helpers import Cluster, cluster_yaml, get, post
from hf_reference import PROMPTS
from metrics_text import total

pytestmark = pytest.mark.multiprocess
FAKES = str(Path(__file__).parent / "fakes")
NEW = 12


def fake_env(report: Path) -> dict:
    return {
        "PYTHONPATH": os.pathsep.join([FAKES, os.environ.get("PYTHONPATH", "")]),
        "AFD_FAKE_NPU_REPORT": str(report),
    }


def reports(report: Path) -> dict[str, dict]:
    """Each process's report (written as `{report}.{pid}.json`), by file."""
    return {f: json.loads(Path(f).read_text()) for f in sorted(glob.glob(f"{report}.*.json"))}


@pytest.fixture(scope="module")
def reference(families):
    return families.ref_ids("longcat_flash", "zero_experts", NEW)  # tiny_checkpoint's


def _on_devices(path: Path) -> None:
    """Node i on the next free device from npu:1; an attention node's TP rank r on its device + r."""
    doc = yaml.safe_load(path.read_text())
    tp = (doc.get("layout") or {}).get("attention_tp", 1)
    free = 1
    for node in doc["nodes"]:
        node["device"] = f"npu:{free}"
        free += tp if node["role"] == "attention" else 1
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


@pytest.mark.parametrize(
    "A,F,micro_batches,overlap,tp",
    [
        (1, 1, 2, True, {}),
        pytest.param(2, 1, 1, True, {}, marks=pytest.mark.slow),  # `make test-slow`, which CI runs too
        pytest.param(1, 2, 2, False, {}, marks=pytest.mark.slow),
        # attention TP over the fake HCCL's collectives: every device and stream rule, on each mode's path
        pytest.param(
            1,
            1,
            2,
            True,
            {"attention_tp": 2, "tp_comm": "flashcomm2", "flashcomm2_otp": 1, "tp_comm_min_tokens": 1},
            marks=pytest.mark.slow,
        ),
        pytest.param(1, 1, 1, True, {"attention_tp": 2, "tp_comm": "allreduce", "kvp": 2}, marks=pytest.mark.slow),
    ],
    ids=["1A1F", "2A1F", "1A2F", "1A1F-tp2-flashcomm2", "1A1F-tp2-kvp2"],
)
def test_afd_decode_on_the_fake_npu_equals_hf(tiny_checkpoint, reference, tmp_path, A, F, micro_batches, overlap, tp):
    path = cluster_yaml(
        tmp_path, tiny_checkpoint, A, F, name="npu", layout={"micro_batches": micro_batches, "overlap": overlap, **tp}
    )
    _on_devices(path)
    report = tmp_path / "fake-npu"
    syncs = (A, F, tp) == (1, 1, {})  # the 1A1F run (make test's) also holds the host-sync bound
    env = {**fake_env(report), "AFD_FAKE_NPU_SYNC_SITES": "1", "AFD_FAKE_NPU_REPORT_S": "0.05"} if syncs else None
    with Cluster(path, env=env or fake_env(report)) as c:
        c.start_all()
        c.wait_ready(timeout=120)
        jobs = [(a, i) for a in range(A) for i in range(len(PROMPTS))]
        with ThreadPoolExecutor(len(jobs)) as pool:  # at once: decode batches that ping-pong can split
            answers = list(
                pool.map(
                    lambda job: post(
                        c.url(f"attn{job[0]}"),
                        "/v1/completions",
                        {"prompt": PROMPTS[job[1]], "max_tokens": NEW, "temperature": 0, "return_token_ids": True},
                    ),
                    jobs,
                )
            )
        for (a, i), (code, body) in zip(jobs, answers):
            assert code == 200, body
            assert body["choices"][0]["token_ids"] == reference[i], f"attn{a}, prompt {i}"
        if syncs:  # warm by now: one-time copies (the rope frequencies) are not a step's
            _check_one_host_sync_per_step(c, report)
    seen = list(reports(report).values())
    assert len(seen) == A * tp.get("attention_tp", 1) + F, "every process ran on the fake device and wrote its report"
    for r in seen:
        assert r["device"]["ops"] > 0
        assert r["device"]["hazards"] == []
        assert r["device"]["unbound"] == []
        assert r["hccl"]["send_behind_recv"] == 0, "a send waited behind a pending receive on one HCCL stream"
        assert r["hccl"]["sends"] > 0 and r["hccl"]["recvs"] > 0


def _syncs(report: Path, c: Cluster) -> tuple[list[dict[str, int]], dict[str, float]]:
    """Per node process, its host syncs by site so far (the fake rewrites its report every 0.5 s), and each
    node's afd_host_syncs_total, scraped at once."""
    time.sleep(1.0)
    urls = {"attn0": c.url("attn0"), "ffn0": f"http://127.0.0.1:{c.node('ffn0')['ports']['metrics']}"}
    counted = {n: total(get(u, "/metrics")[1].decode(), "afd_host_syncs_total") for n, u in urls.items()}
    return [r["device"]["host_sync_sites"] for r in reports(report).values()], counted


def _check_one_host_sync_per_step(c: Cluster, report: Path) -> None:
    """Issue 24's bound: the attention node learns its sampled tokens once per step and the FFN node reads its
    step header once; nothing else on the hot path waits for the device (exchange waits are stream-ordered,
    copies to the device are staged in pinned memory, the FFN times its compute with events). Idle steps (an
    attention node with nothing to run) each cost one read on both sides and are taken out. The nodes write
    their reports on their own clocks, so the FFN node's idle steps are not the attention node's count: there,
    every sync must be a step header's read, one per step, idle or not."""
    n = 10
    body = {"prompt": PROMPTS[0], "max_tokens": n, "temperature": 0, "ignore_eos": True}
    before, counted0 = _syncs(report, c)
    code, out = post(c.url("attn0"), "/v1/completions", body)
    after, counted1 = _syncs(report, c)
    assert code == 200, out
    delta = [{k: v - b.get(k, 0) for k, v in a.items() if v - b.get(k, 0)} for b, a in zip(before, after)]
    (attn,) = [d for d in delta if any("sample" in k for k in d)]
    (ffn,) = [d for d in delta if d is not attn]
    scrape = {k: v for k, v in ffn.items() if " in _collect at observability/metrics.py" in k}  # not a step's
    ffn = {k: v for k, v in ffn.items() if k not in scrape}
    idle = sum(v for k, v in attn.items() if " in idle " in k)
    steps = n  # one prefill step and n - 1 decode steps
    assert sum(attn.values()) - idle <= steps, attn
    assert ffn and all(" in decode at dataplane/protocol.py" in k for k in ffn), ffn  # StepHeader.decode
    # afd_host_syncs_total counts what the fake saw. Slack: the fake's report may be 0.05 s older than the
    # scrape, and idle steps (one sync each on both nodes) run back to back between requests.
    for name, seen in (("attn0", attn), ("ffn0", {**ffn, **scrape})):
        counted = counted1[name] - counted0[name]
        assert counted >= steps and abs(counted - sum(seen.values())) <= 6, (name, counted, seen)


_PAIR = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {fakes!r})
    from afd.backend import get_backend
    from afd.dataplane.transport import DataPlane, PeerError, rendezvous_store
    rank = int(sys.argv[1])
    store, sock = rendezvous_store(rank, "127.0.0.1", {port}, 30)
    plane = DataPlane(get_backend("npu", rank + 1), rank, 2, store, timeout_s={timeout})
    plane.handshake([1 - rank], None, "f")  # the pair's communicators form (HCCL: at their first op)
    buf = torch.empty(4, device=plane.backend.device)
    if rank == 0:
        t0 = time.monotonic()
        try:
            plane.wait(plane.irecv(buf, 1), 1, "a receive the peer never answers")
        except PeerError as e:
            print("PeerError", e.peer, round(time.monotonic() - t0, 1), e, flush=True)
    else:
        time.sleep({timeout} + 6)
""")


def test_a_silent_peer_ends_in_a_timeout_not_a_hang(tmp_path):
    """HCCL's wait() ignores its timeout without blocking wait, which the data plane turns off: its watchdog
    aborts the pair when the deadline passes, and the wait ends then."""
    from cluster_helpers import free_ports

    code = _PAIR.format(fakes=FAKES, port=free_ports(1)[0], timeout=2)
    env = {**os.environ, "AFD_FAKE_HANG_S": "6"}
    env.pop("HCCL_BLOCKING_WAIT", None)
    env.pop("TORCH_HCCL_BLOCKING_WAIT", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=Path(__file__).parent.parent,
        )
        for r in (0, 1)
    ]
    t0 = time.monotonic()
    out = procs[0].communicate(timeout=60)[0]
    procs[1].kill()
    procs[1].wait()
    assert "PeerError 1" in out, out
    assert "timed out" in out and time.monotonic() - t0 < 45, out
    waited = float(out.split("PeerError 1 ")[1].split()[0])
    assert waited < 5, f"the wait took {waited}s: the 2s timeout did not hold"


def test_a_conflicting_blocking_wait_setting_is_refused():
    from afd.dataplane.transport import apply_comm_env

    class Hccl:
        dist_backend = "hccl"

        def comm_env(self):
            return {"HCCL_BLOCKING_WAIT": "1"}

    os.environ["HCCL_BLOCKING_WAIT"] = "0"
    try:
        with pytest.raises(ValueError, match="HCCL_BLOCKING_WAIT=0.*needs HCCL_BLOCKING_WAIT=1"):
            apply_comm_env(Hccl())
    finally:
        del os.environ["HCCL_BLOCKING_WAIT"]
