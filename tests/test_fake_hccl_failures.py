"""Failure handling that matches HCCL, on the fake torch_npu (tests/fakes): tearing a group down waits for
its queued work (so a dead peer's send hangs it), an abort does not; a communicator shared by a whole group
(P2P_HCCL_BUFFSIZE=0) cannot deadlock the handshake, since no group of the data plane spans more than one pair
(afd.dataplane.pairs); and a TP collective past its deadline aborts its group instead of hanging. The data
plane on the fake HCCL (it aborts the failed pair only and never tears down a group with work queued on it):
test_fake_hccl_dataplane.py.

Each case runs its ranks as processes (the fake's "hccl" group moves bytes over gloo between them).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from cluster_helpers import free_ports
from fake_hccl_helpers import FAKES, _run

pytestmark = pytest.mark.multiprocess
ROOT = Path(__file__).parent.parent


_GROUPS = textwrap.dedent("""
    import sys, threading, time, torch, torch.distributed as dist
    from datetime import timedelta
    sys.path.insert(0, {fakes!r})
    import torch_npu
    from torch_npu.hccl import HangError
    rank, mode = int(sys.argv[1]), {mode!r}
    torch.npu.set_device(rank + 1)
    dist.init_process_group("hccl", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    a, b = dist.new_group([0, 1]), dist.new_group([0, 1])  # two groups of two ranks each, as a pair's are
    buf = torch.zeros(4, device=torch.device("npu", rank + 1))
    if rank == 1:
        never = dist.irecv(torch.zeros(4, device=buf.device), 0, group=a)  # forms a's pair communicator
        time.sleep(2)
        if mode == "abort":
            dist.isend(torch.ones(4, device=buf.device), 0, group=b).wait(timedelta(seconds=10))
        time.sleep(3)
        sys.exit(0)
    queued = dist.irecv(buf, 1, group=a)  # rank 1 never sends on `a`: a receive that never completes
    if mode == "destroy":
        try:
            dist.destroy_process_group()
            print("destroyed", flush=True)
        except HangError as e:
            print("HangError", e, flush=True)
        sys.exit(0)
    other = dist.irecv(torch.zeros(4, device=buf.device), 1, group=b)
    threading.Timer(1.0, lambda: a._get_backend(torch.device("npu")).abort_hccl_comm("test")).start()
    t0 = time.monotonic()
    try:
        queued.wait(timedelta(seconds=20))
    except RuntimeError as e:
        print("queued wait failed after", round(time.monotonic() - t0, 1), e, flush=True)
    print("other pair:", other.wait(timedelta(seconds=10)), flush=True)
    try:
        dist.isend(buf, 1, group=a)
    except HangError as e:
        print("post after abort: HangError", e, flush=True)
    dist.distributed_c10d._abort_process_group()
    print("forgotten without shutdown", torch_npu.report()["hccl"], flush=True)
""")


@pytest.mark.slow  # multi-process runs that wait out a hang; `make test-slow`, which CI runs
def test_fake_hccl_shutdown_with_queued_work_hangs():
    """ProcessGroupHCCL::shutdown synchronizes the group's streams: a receive whose peer never sends
    blocks it (HCCL_EXEC_TIMEOUT on a real device); the fake says so instead of returning."""
    out = _run(_GROUPS.format(fakes=FAKES, port=free_ports(1)[0], mode="destroy"), 2, HCCL_BLOCKING_WAIT="1")[0]
    assert "HangError fake hccl: shutdown() of a group with 1 send/recv that never completed (recv with rank 1)" in out
    assert "up to HCCL_EXEC_TIMEOUT" in out and "destroyed" not in out, out


def test_fake_hccl_abort_fails_the_pairs_work_at_once_and_leaves_other_pairs():
    """abort_hccl_comm (torch_npu's abort, the backend's abort_group) from another thread: the blocked
    wait on the aborted group fails at once, another group's receive completes, a later post on the
    aborted group is refused, and forgetting the groups (_abort_process_group) never calls shutdown()."""
    out = _run(_GROUPS.format(fakes=FAKES, port=free_ports(1)[0], mode="abort"), 2, HCCL_BLOCKING_WAIT="1")[0]
    assert "queued wait failed after" in out and "communicators were aborted (test)" in out, out
    waited = float(out.split("queued wait failed after ")[1].split()[0])
    assert waited < 5, f"the aborted wait ran {waited}s: the abort did not end it"
    assert "other pair: True" in out, out
    assert "post after abort: HangError" in out and "HcclCommInitRootInfo" in out, out
    report = out.split("forgotten without shutdown ")[1].strip().splitlines()[0]
    assert "'aborts': 1" in report and "'shutdowns': 0" in report and "'shutdown_hangs': []" in report, out


_OLD_HANDSHAKE = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from datetime import timedelta
    sys.path.insert(0, {fakes!r})
    import torch_npu
    from torch_npu.hccl import HangError
    rank = int(sys.argv[1])
    torch.npu.set_device(rank + 1)
    dist.init_process_group("hccl", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                            timeout=timedelta(seconds=30))
    up, down = dist.group.WORLD, dist.new_group([0, 1, 2])  # afd's old layout: two groups over every rank
    peers, t = ([2] if rank < 2 else [0, 1]), torch.zeros(4, device=torch.device("npu", rank + 1))
    try:
        for p in peers:  # the old handshake: pair by pair, each op waited for before the next
            ops = [(dist.isend, up if p > rank else down), (dist.irecv, down if p > rank else up)]
            for op, group in ops if rank < p else ops[::-1]:
                op(t, p, group=group).wait(timedelta(seconds=30))
        print("handshake done", flush=True)
    except HangError as e:
        print("HangError", e, flush=True)
""")

_PER_PAIR_HANDSHAKE = textwrap.dedent("""
    import sys, threading, torch
    sys.path.insert(0, {fakes!r})
    from afd.backend import get_backend
    from afd.control.server import ControlServer
    from afd.dataplane.pairs import ATTENTION, FFN, PairLink, handshake
    from afd.dataplane.rendezvous import ControlStore
    from afd.dataplane.transport import DataPlane
    rank = int(sys.argv[1])  # attention ranks 0 and 1, the FFN rank 2
    server = ControlServer("127.0.0.1", {port}, workers=8) if rank == 2 else None  # the FFN node's store
    store = ControlStore("127.0.0.1:{port}", 30)
    backend = get_backend("npu", rank + 1)
    plane = DataPlane(backend, rank, timeout_s=20)

    def form(r, side):
        backend.bind_thread()
        link = PairLink(backend, store, f"attn{{r}}-ffn0", side, 20)
        handshake(link, None, 20)
        return link

    if rank < 2:
        if rank == 1:
            store.get("attn0 served")  # absent until attn0's pair formed, handshook and exchanged
        plane.add(2, form(rank, ATTENTION))
        plane.wait(plane.isend(torch.full((4,), rank + 1.0, device=backend.device), 2), 2, "send")
        print("handshake done", flush=True)
    else:
        links = {{}}
        threads = [threading.Thread(target=lambda r=r: links.update({{r: form(r, FFN)}})) for r in (0, 1)]
        for t in threads:
            t.start()
        for r, t in enumerate(threads):
            t.join(30)
            plane.add(r, links[r])
            y = torch.zeros(4, device=backend.device)
            plane.wait(plane.irecv(y, r), r, "receive")
            print(f"attn{{r}} served", y.cpu().tolist(), "with attn1's pair formed:", 1 in links, flush=True)
            if r == 0:
                store.set("attn0 served", "1")
        print("handshake done", flush=True)
    plane.close()
""")


@pytest.mark.slow  # multi-process runs that wait out a hang; `make test-slow`, which CI runs
def test_the_handshake_cannot_deadlock_on_a_group_wide_hccl_communicator():
    """With P2P_HCCL_BUFFSIZE=0 HCCL forms one communicator per group, at the first op of
    every rank of it. Groups over every rank (afd's layout before per-pair worlds), each handshake op waited
    for at once, deadlock at 2 attention ranks: the FFN and attention rank 0 wait in the second group's
    formation for rank 1, which waits for the FFN to take its message (the fake models that: the first half).
    The data plane's groups span one pair each, so no communicator needs a third process: attention rank 0's
    pair forms, handshakes and exchanges while rank 1 is not there at all, and rank 1's pair forms after."""
    env = {"P2P_HCCL_BUFFSIZE": "0", "HCCL_BLOCKING_WAIT": "1", "AFD_FAKE_HANG_S": "5"}
    old = _run(_OLD_HANDSHAKE.format(fakes=FAKES, port=free_ports(1)[0]), 3, **env)
    assert any("HangError" in o and "HcclCommInitRootInfo" in o for o in old), old
    env["HCCL_BLOCKING_WAIT"] = "0"  # the data plane's own setting (stream-ordered waits; it refuses "1")
    new = _run(_PER_PAIR_HANDSHAKE.format(fakes=FAKES, port=free_ports(1)[0]), 3, **env)
    assert all("handshake done" in o for o in new), new
    assert "attn0 served [1.0, 1.0, 1.0, 1.0] with attn1's pair formed: False" in new[2], new[2]
    assert "attn1 served [2.0, 2.0, 2.0, 2.0] with attn1's pair formed: True" in new[2], new[2]


_TP = textwrap.dedent("""
    import json, os, sys, time, torch, torch.distributed as dist
    sys.path.insert(0, {fakes!r})
    import torch_npu
    from afd.backend.npu import NpuBackend
    from afd.model.tp.comm import TPComm, TPError
    from afd.config.tp import TPConfig, plan
    rank = int(sys.argv[1])
    dist.init_process_group("hccl", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    comm = TPComm(TPConfig(size=2), rank=rank, ranks=[0, 1], backend=NpuBackend(rank + 1), timeout_s=1)
    y = torch.ones(4, device=comm.backend.device)
    dist.barrier()  # both ranks ready: the 1s deadline below times the collective, not a slow start under load
    with comm.plan(plan(comm.cfg, 4)):
        comm.reduce(y)
        print("reduced", y.cpu().tolist(), flush=True)
        if rank == 1:
            time.sleep(4)  # alive but silent: never joins the next all_reduce
            os._exit(0)
        t0 = time.monotonic()
        try:
            comm.reduce(y)
            comm.check()
            print("no error", flush=True)
        except TPError as e:
            print("TP failed after", round(time.monotonic() - t0, 1), e, flush=True)
    print("report", json.dumps(torch_npu.report()["hccl"]), flush=True)
    os._exit(0)
""")


def test_a_tp_collective_past_its_deadline_aborts_the_group_instead_of_hanging():
    """On HCCL a TP collective's wait is stream-ordered (the host goes on) and ignores its timeout, so a rank
    that never joins would hang the others: the TP group's watchdog holds the deadline, aborts the group's
    communicators once it passes, and the collective fails with a TPError naming the timeout."""
    outs = _run(_TP.format(fakes=FAKES, port=free_ports(1)[0]), 2)
    assert all("reduced [2.0, 2.0, 2.0, 2.0]" in out for out in outs), outs
    out = outs[0]
    assert "TP failed after" in out and "all_reduce in the TP group (ranks [0, 1]) timed out after 1s" in out, out
    waited = float(out.split("TP failed after ")[1].split()[0])
    assert waited < 4, f"the collective ran {waited}s past a 1s deadline (the fake's hang is 20s)"  # poll + slack
    report = json.loads(out.split("report ")[1].splitlines()[0])
    assert report["aborts"] == 1 and report["shutdown_hangs"] == [], report
