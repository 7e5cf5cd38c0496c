"""AFD decode through NpuBackend on the fake Ascend device (tests/fakes/torch_npu): real node processes,
HCCL played by gloo, every device rule of the fake checked as the nodes run, tokens compared with HF.

Nodes sit on devices other than 0 (attention on npu:1, FFN nodes on npu:2..), so a thread that forgets
to bind its node's device acts on the wrong one, as it would on a real machine. Each node's fake
writes what it saw (hazards, unbound threads, sends queued behind receives, host syncs by site) as it runs;
every case holds each node to one host sync per decode step (tests/npu_fake.py).
"""

from __future__ import annotations

import os
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster_helpers import Cluster, cluster_yaml, get, post
from hf_reference import PROMPTS
from metrics_text import total
from npu_fake import FAKES, check_one_host_sync_per_step, on_devices, reports, snapshot, sync_env
from rank_processes import run_ranks

pytestmark = pytest.mark.multiprocess
NEW = 12


@pytest.fixture(scope="module")
def reference(families):
    return families.ref_ids("longcat_flash", "zero_experts", NEW)  # tiny_checkpoint's


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
        # fp8 MoE inputs as uint8 messages over the fake HCCL (no float8 in HCCL_DTYPES); quantized tokens
        # are not held to HF's (tests/test_exchange_dtype.py reports how far they move), the device rules are
        pytest.param(1, 1, 2, True, {"exchange_dtype": "fp8"}, marks=pytest.mark.slow),
    ],
    ids=["1A1F", "2A1F", "1A2F", "1A1F-tp2-flashcomm2", "1A1F-tp2-kvp2", "1A1F-fp8-exchange"],
)
def test_afd_decode_on_the_fake_npu_equals_hf(tiny_checkpoint, reference, tmp_path, A, F, micro_batches, overlap, tp):
    path = cluster_yaml(
        tmp_path, tiny_checkpoint, A, F, name="npu", layout={"micro_batches": micro_batches, "overlap": overlap, **tp}
    )
    on_devices(path)
    report = tmp_path / "fake-npu"
    with Cluster(path, env=sync_env(report)) as c:
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
            if "exchange_dtype" not in tp:
                assert body["choices"][0]["token_ids"] == reference[i], f"attn{a}, prompt {i}"
            else:  # served (an EOS may come early): the fake's device and HCCL rules below are what is checked
                assert 0 < len(body["choices"][0]["token_ids"]) <= NEW, body
        # warm by now: one-time copies (rope tables) are not a step's
        check_one_host_sync_per_step(
            c.url("attn0"), snapshot(report, c), {n["name"]: n["role"] for n in c.doc["nodes"]}
        )
        # prefetch is on by default on Ascend: the router's and the last-chosen experts' slices went through
        # the fake npu_prefetch's checks, within a budget computed from the measured waits
        for n in c.doc["nodes"]:
            if n["role"] == "ffn":
                text = get(f"http://127.0.0.1:{n['ports']['metrics']}", "/metrics")[1].decode()
                assert total(text, "afd_prefetch_bytes_total") > 0 and total(text, "afd_prefetch_budget_bytes") > 0
    seen = list(reports(report).values())
    assert len(seen) == A * tp.get("attention_tp", 1) + F, "every process ran on the fake device and wrote its report"
    for r in seen:
        assert r["device"]["ops"] > 0
        assert r["device"]["hazards"] == []
        assert r["device"]["unbound"] == []
        assert r["hccl"]["send_behind_recv"] == 0, "a send waited behind a pending receive on one HCCL stream"
        assert r["hccl"]["sends"] > 0 and r["hccl"]["recvs"] > 0


_PAIR = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {fakes!r})
    from afd.backend import get_backend
    from afd.dataplane.pairs import PairLink, handshake
    from afd.dataplane.rendezvous import rendezvous_store
    from afd.dataplane.transport import DataPlane, PeerError
    rank = int(sys.argv[1])  # 0: the attention end, 1: the FFN end
    store, server = rendezvous_store(rank, "127.0.0.1", {port}, 30)
    plane = DataPlane(get_backend("npu", rank + 1), rank, timeout_s={timeout})
    link = PairLink(plane.backend, store, "attn0-ffn0", rank, {timeout})
    handshake(link, None, 30)  # the pair's communicators form (HCCL: at their first op)
    plane.add(1 - rank, link)
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
    t0 = time.monotonic()
    out = run_ranks(code, 2, timeout=60, env=env, wait=[0])[0].output
    assert "PeerError 1" in out, out
    assert "timed out" in out and time.monotonic() - t0 < 45, out
    waited = float(out.split("PeerError 1 ")[1].split()[0])
    assert waited < 5, f"the wait took {waited}s: the 2s timeout did not hold"


def test_a_conflicting_blocking_wait_setting_is_refused():
    from afd.dataplane.rendezvous import apply_comm_env

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
