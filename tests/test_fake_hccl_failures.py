"""Failure handling that matches HCCL, on the fake torch_npu (tests/fakes): tearing a group down waits for
its queued work (so a dead peer's send hangs it), an abort does not, and afd's data plane never tears down
a group with work queued on it: it aborts the failed pair only and serves the others on. And a
communicator shared by a whole group (P2P_HCCL_BUFFSIZE=0) cannot deadlock the handshake: no group of the
data plane spans more than one pair (afd.dataplane.pairs).

Each case runs its ranks as processes (the fake's "hccl" group moves bytes over gloo between them).
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from cluster_helpers import free_ports
from rank_processes import run_ranks

pytestmark = pytest.mark.multiprocess
FAKES = str(Path(__file__).parent / "fakes")
ROOT = Path(__file__).parent.parent


def _run(code: str, ranks: int, timeout: float = 90, **env) -> list[str]:
    """Runs `code` as `ranks` processes (argv[1] = the rank); returns each one's output."""
    return [r.output for r in run_ranks(code, ranks, timeout, {**os.environ, "AFD_FAKE_HANG_S": "20", **env})]


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


_PLANE = textwrap.dedent("""
    import json, os, sys, threading, time, torch
    sys.path.insert(0, {fakes!r})
    import torch_npu
    from afd.backend import get_backend
    from afd.control.server import ControlServer
    from afd.dataplane.pairs import ATTENTION, FFN, PairLink, handshake
    from afd.dataplane.rendezvous import ControlStore
    from afd.dataplane.transport import DataPlane, PeerError
    rank = int(sys.argv[1])  # attention ranks 0 and 1, the FFN rank 2
    server = ControlServer("127.0.0.1", {port}, workers=8) if rank == 2 else None  # the FFN node's store
    store = ControlStore("127.0.0.1:{port}", 30)
    backend = get_backend("npu", rank + 1)
    plane = DataPlane(backend, rank, timeout_s=20)

    def form(r, side):  # one pair: its own two-rank world, the handshake over it
        backend.bind_thread()
        link = PairLink(backend, store, f"attn{{r}}-ffn0", side, 20)
        handshake(link, None, 20)
        return link

    if rank < 2:
        plane.add(2, form(rank, ATTENTION))
    else:  # each pair forms on a thread of its own, as ffn_node/pairs.py forms them
        links = {{}}
        threads = [threading.Thread(target=lambda r=r: links.update({{r: form(r, FFN)}})) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for r in (0, 1):
            plane.add(r, links[r])
    dev = plane.backend.device
    if rank == 1:
        time.sleep(8)  # hangs, alive but silent: the FFN's send to it stays queued, its header never comes
        os._exit(0)
    if rank == 0:
        plane.wait(plane.isend(torch.full((4,), 7.0, device=dev), 2), 2, "step header send")
        y = torch.zeros(4, device=dev)
        plane.wait(plane.irecv(y, 2), 2, "MoE output receive")
        print("attention 0 served:", y.tolist(), flush=True)
        plane.close()
        print("report", json.dumps(torch_npu.report()["hccl"]), flush=True)
        sys.exit(0)
    queued = plane.isend(torch.ones(4, device=dev), 1)  # a y send rank 1 never receives
    h0, h1 = torch.zeros(4, device=dev), torch.zeros(4, device=dev)
    w0, w1 = plane.irecv(h0, 0), plane.irecv(h1, 1)
    plane.wait(w0, 0, "step header receive")
    threading.Timer(1.0, plane.abort, args=(1,)).start()  # as a watchdog would, on the control plane's word
    t0 = time.monotonic()
    try:
        plane.wait(w1, 1, "step header receive")
    except PeerError as e:
        print("rank 1 failed after", round(time.monotonic() - t0, 1), "peer", e.peer, e, flush=True)
    plane.wait(plane.isend(h0 * 2, 0), 0, "MoE output send")  # the other pair is served on
    try:
        plane.isend(h1, 1)
    except PeerError as e:
        print("post refused:", e, flush=True)
    plane.close()
    print("report", json.dumps(torch_npu.report()["hccl"]), flush=True)
""")


@pytest.mark.slow  # multi-process runs that wait out a hang; `make test-slow`, which CI runs
def test_data_plane_aborts_only_the_failed_pair_and_never_tears_down_queued_work():
    """2A1F on the fake HCCL (each pair formed and handshaken on its own): attention rank 1 hangs with
    the FFN's send to it queued. An abort of its pair from another thread (what a watchdog does on the
    control plane's word) ends the FFN's wait on it at once, well inside comm_timeout; the FFN serves
    attention rank 0 on; and its teardown aborts instead of synchronizing streams (a shutdown() would hang
    on the queued send: see the first test), while rank 0, with nothing queued, shuts its pair down as
    usual."""
    outs = _run(_PLANE.format(fakes=FAKES, port=free_ports(1)[0]), 3)
    attn, ffn = outs[0], outs[2]
    assert "attention 0 served: [14.0, 14.0, 14.0, 14.0]" in attn, attn
    assert "rank 1 failed after" in ffn and "peer 1" in ffn and "its pair was aborted (DataPlane.abort)" in ffn, ffn
    waited = float(ffn.split("rank 1 failed after ")[1].split()[0])
    assert waited < 5, f"the wait on the aborted pair ran {waited}s (timeout 20s)"
    assert "post refused:" in ffn and "refused: its pair was aborted" in ffn, ffn
    ffn_report = json.loads(ffn.split("report ")[1].splitlines()[0])
    assert ffn_report["shutdown_hangs"] == [], ffn
    # rank 1's pair at the abort; rank 0's at close, since PeerErrors were made in the process after it formed
    assert ffn_report["aborts"] == 4, "each of the FFN's two pairs has two groups, each aborted once"
    attn_report = json.loads(attn.split("report ")[1].splitlines()[0])
    assert attn_report["shutdown_hangs"] == [] and attn_report["aborts"] == 0 and attn_report["shutdowns"] > 0, attn


_REPLACED_PEER = textwrap.dedent("""
    import json, queue, sys, threading, time, torch
    from types import SimpleNamespace
    sys.path.insert(0, {fakes!r})
    import torch_npu
    from afd.backend import get_backend
    from afd.dataplane.exchange import RemoteMoE
    from afd.dataplane.pairs import PairLink, handshake
    from afd.dataplane.rendezvous import rendezvous_store
    from afd.dataplane.transport import DataPlane
    from ffn_node.server import FFNServer
    rank = int(sys.argv[1])  # 0: the attention node (the pair's rank 0), 1: the FFN node
    store, server = rendezvous_store(rank, "127.0.0.1", {port}, 30)
    backend = get_backend("npu", rank + 1)

    def link(key):
        backend.bind_thread()
        lk = PairLink(backend, store, key, rank, 20)
        handshake(lk, None, 20)
        return lk

    if rank == 0:  # its first pair stays silent, as a dead node's does: the FFN's header receive never completes
        first = link("old")
        time.sleep(3)
        first.close(queued=True)
        plane = DataPlane(backend, 0, 20)
        plane.add(1, link("new"))  # the replacement's pair
        moe = RemoteMoE(plane, [1], 8, torch.float32, backend.device)
        print("idle step answered:", moe.idle(), flush=True)
        moe.leave()
        sys.exit(0)
    ffn = SimpleNamespace(cfg=SimpleNamespace(hidden_size=8, moe_layers=(1,)), mtp_layers=())
    plane, formed = DataPlane(backend, 1, 20), queue.SimpleQueue()
    formed.put([(0, "attn0", link("old"))])

    def replaced():
        time.sleep(1.0)
        plane.abort(0, "attn0 missed its heartbeats")  # the heartbeat thread, on the control plane's word
        formed.put([(0, "attn0", link("new"))])  # the replacement's pair, formed by the Pairs service's thread

    threading.Thread(target=replaced).start()
    srv = FFNServer(ffn, backend, plane, formed, torch.float32, rejoin_timeout=30)
    print("served:", srv.serve().name, list(srv.gone.values()), flush=True)
    print("report", json.dumps(torch_npu.report()["device"]["hazards"]), flush=True)
""")


@pytest.mark.slow  # two fake-NPU processes and a silent peer; `make test-slow`, which CI runs
def test_an_ffn_node_receives_a_replaced_peer_s_headers_into_new_memory():
    """An attention node dies while the FFN node waits for its step header: that receive never completes
    (it stays on its stream). The FFN node receives the replacement's headers into a new buffer, not into the
    one the dead peer's receive may still write (the fake device calls that a hazard; the FFN node then
    dropped the replacement at its first step, every time it formed its pair: issue 26's intermittent
    rejoin failure)."""
    attn, ffn = _run(_REPLACED_PEER.format(fakes=FAKES, port=free_ports(1)[0]), 2, timeout=60, AFD_FAKE_HANG_S="10")
    assert "served: LEFT []" in ffn, ffn
    assert json.loads(ffn.split("report ")[1].splitlines()[0]) == [], ffn
    assert "idle step answered: 0" in attn, attn


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
    """N2 of issue 24: with P2P_HCCL_BUFFSIZE=0 HCCL forms one communicator per group, at the first op of
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
    from afd.model.tp.config import TPConfig, plan
    rank = int(sys.argv[1])
    dist.init_process_group("hccl", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    comm = TPComm(TPConfig(size=2), rank=rank, ranks=[0, 1], backend=NpuBackend(rank + 1), timeout_s=1)
    y = torch.ones(4, device=comm.backend.device)
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


_PAIR = textwrap.dedent("""
    import json, sys, threading, time, torch
    sys.path.insert(0, {fakes!r})
    import torch_npu
    from afd.backend import get_backend
    from afd.dataplane.pairs import PairLink
    from afd.dataplane.rendezvous import rendezvous_store
    rank = int(sys.argv[1])  # 0: the attention side, 1: the FFN side
    store, server = rendezvous_store(rank, "127.0.0.1", {port}, 30)
    link = PairLink(get_backend("npu", rank + 1), store, "attn0@i0-ffn0@i0", rank, 20)
    dev = link.backend.device
    if rank == 0:
        link.isend(torch.full((4,), 3.0, device=dev)).wait()
        time.sleep(4)  # then silent, alive: the FFN's next receive never completes
        sys.exit(0)
    x = torch.zeros(4, device=dev)
    link.irecv(x).wait()
    print("received", x.cpu().tolist(), flush=True)
    pending = link.irecv(torch.zeros(4, device=dev))
    threading.Timer(1.0, link.abort).start()  # what a watchdog does on the control plane's word
    t0 = time.monotonic()
    try:
        pending.wait()
        torch.npu.synchronize()
        print("no error", flush=True)
    except RuntimeError as e:
        print("aborted after", round(time.monotonic() - t0, 1), flush=True)
    print("report", json.dumps(torch_npu.report()["hccl"]), flush=True)
""")


@pytest.mark.slow  # two fake-NPU processes and a silent peer: about 20 s on 2 cores; `make test-slow`
def test_a_standalone_pair_group_on_the_fake_hccl_is_aborted_like_a_world_s():
    """A pair's own world (afd.dataplane.pairs: torch_npu's standalone ProcessGroupHCCL constructor, faked)
    moves tensors, and an abort from another thread ends a receive whose peer went silent at once."""
    outs = _run(_PAIR.format(fakes=FAKES, port=free_ports(1)[0]), 2, timeout=60)
    ffn = outs[1]
    assert "received [3.0, 3.0, 3.0, 3.0]" in ffn, ffn
    assert "aborted after" in ffn, ffn
    assert float(ffn.split("aborted after ")[1].split()[0]) < 5, ffn
    report = json.loads(ffn.split("report ")[1].splitlines()[0])
    assert report["aborts"] == 2 and report["shutdown_hangs"] == [], ffn
