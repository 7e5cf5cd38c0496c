"""afd's data plane on the fake HCCL (tests/fakes), failing as HCCL does: it never tears down a group with
work queued on it but aborts the failed pair only and serves the others on; an FFN node receives a replaced
peer's headers into new memory, not the buffer the dead peer's receive may still write; and a pair's own
standalone group is aborted like a world's. The fake HCCL's own failure semantics:
test_fake_hccl_failures.py.

Each case runs its ranks as processes (the fake's "hccl" group moves bytes over gloo between them).
"""

from __future__ import annotations

import json
import textwrap

import pytest
from cluster_helpers import free_ports
from fake_hccl_helpers import FAKES, _run

pytestmark = pytest.mark.multiprocess


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
    from ffn_node.peers import FormedPair
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
    formed.put([FormedPair(0, "attn0", link("old"))])

    def replaced():
        time.sleep(1.0)
        plane.abort(0, "attn0 missed its heartbeats")  # the heartbeat thread, on the control plane's word
        formed.put([FormedPair(0, "attn0", link("new"))])  # the replacement, formed by the Pairs thread

    threading.Thread(target=replaced).start()
    srv = FFNServer(ffn, backend, plane, formed, torch.float32, rejoin_timeout=30)
    print("served:", srv.serve().name, list(srv.peers.gone.values()), flush=True)
    print("report", json.dumps(torch_npu.report()["device"]["hazards"]), flush=True)
""")


@pytest.mark.slow  # two fake-NPU processes and a silent peer; `make test-slow`, which CI runs
def test_an_ffn_node_receives_a_replaced_peer_s_headers_into_new_memory():
    """An attention node dies while the FFN node waits for its step header: that receive never completes
    (it stays on its stream). The FFN node receives the replacement's headers into a new buffer, not into the
    one the dead peer's receive may still write (the fake device calls that a hazard; the FFN node then
    dropped the replacement at its first step, every time it formed its pair: an intermittent
    rejoin failure)."""
    attn, ffn = _run(_REPLACED_PEER.format(fakes=FAKES, port=free_ports(1)[0]), 2, timeout=60, AFD_FAKE_HANG_S="10")
    assert "served: LEFT []" in ffn, ffn
    assert json.loads(ffn.split("report ")[1].splitlines()[0]) == [], ffn
    assert "idle step answered: 0" in attn, attn


_STANDALONE = textwrap.dedent("""
    import sys, threading, torch, torch.distributed as dist
    sys.path.insert(0, {fakes!r})
    import torch_npu
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL
    from afd.backend import get_backend
    from afd.dataplane.pairs import PairLink
    store, links = dist.HashStore(), {{}}

    def form(rank):  # both ends of one pair in this process, each on its own device
        links[rank] = PairLink(get_backend("npu", rank + 1), store, "attn0@i0-ffn0@i0", rank, 20)

    ends = [threading.Thread(target=form, args=(r,)) for r in (0, 1)]
    [t.start() for t in ends]
    [t.join(30) for t in ends]
    a, f = links[0], links[1]
    print("torch.distributed.ProcessGroupHCCL:", hasattr(dist, "ProcessGroupHCCL"))
    g = a.to_ffn
    print("class:", type(g) is ProcessGroupHCCL, isinstance(g, torch._C._distributed_c10d.Backend),
          hasattr(g, "_get_backend"))
    ids = [g._hccl_options.group_id for g in (a.to_ffn, a.to_attention, f.to_ffn)]
    print("group ids:", *ids)
    x = torch.zeros(4, device=f.backend.device)
    got = threading.Thread(target=lambda: f.irecv(x).wait())  # a communicator forms at both ends' first op
    got.start()
    a.isend(torch.full((4,), 3.0, device=a.backend.device)).wait()
    got.join(30)
    print("received", x.cpu().tolist())
    f.abort()
    print("aborts", torch_npu.report()["hccl"]["aborts"], f.to_ffn._aborted, f.to_attention._aborted)
""")


def test_a_pair_group_is_torch_npus_standalone_hccl_backend_named_and_aborted():
    """afd's pair groups as torch_npu 2.14's wheel makes a standalone ProcessGroupHCCL: reached as
    torch_npu._C._distributed_c10d.ProcessGroupHCCL (the fake, like the wheel, sets no
    torch.distributed.ProcessGroupHCCL), built with Options whose group_id is the pair's and direction's own,
    and a c10d Backend without _get_backend, which afd's abort must therefore not call: each of the pair's
    two groups is aborted (before, the AttributeError was swallowed and nothing was aborted)."""
    (out,) = _run(_STANDALONE.format(fakes=FAKES), 1, timeout=60)
    assert "torch.distributed.ProcessGroupHCCL: False" in out, out
    assert "class: True True False" in out, out
    key = "afd/pair/attn0@i0-ffn0@i0"
    assert f"group ids: {key}/to-ffn {key}/to-attention {key}/to-ffn" in out, out
    assert "received [3.0, 3.0, 3.0, 3.0]" in out, out
    assert "aborts 2 afd: data plane abort afd: data plane abort" in out, out


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
