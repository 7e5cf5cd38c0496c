"""On gloo: a peer that hangs (SIGSTOP: alive, its sockets open) holds no wait of this end past the
abort that the heartbeat's verdict makes. gloo has no abort of its own; the pair's groups shut their connections
down (afd/backend/gloo_pairs.py), found when they formed, and only those: another pair of this process keeps
exchanging, and the rendezvous store keeps answering."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from cluster_helpers import ROOT, free_ports
from test_pairs import _form, _round_trip

from afd.backend import get_backend
from afd.control.server import ControlServer
from afd.dataplane.pairs import FFN, PairLink
from afd.dataplane.rendezvous import ControlStore
from afd.dataplane.transport import DataPlane, PeerError

# The attention end, in a process of its own: forms its pair, answers one round trip, posts a receive, then
# stops itself (a hang). Once continued, it reports how its pending receive ended.
_PEER = r"""
import os, signal, sys, torch
from afd.backend import get_backend
from afd.dataplane.pairs import ATTENTION, PairLink
from afd.dataplane.rendezvous import ControlStore
store = ControlStore(sys.argv[1], 20)
link = PairLink(get_backend("cpu"), store, "attn0@i0-ffn0@i0", ATTENTION, 20)
x = torch.full((4,), 3.0)
link.isend(x).wait()
back = torch.empty(4)
link.irecv(back).wait()
print("exchanged", float(back[0]), flush=True)
pending = link.irecv(torch.empty(4))
os.kill(os.getpid(), signal.SIGSTOP)
try:
    pending.wait()
    print("receive: completed", flush=True)
except RuntimeError as e:
    print("receive: failed", str(e).splitlines()[0][:200], flush=True)
"""
ABORT_S = 0.5  # after the peer stopped: what the heartbeat's verdict stands in for
BOUND_S = 1.0  # no wait outlives the verdict by more than a second


@pytest.fixture
def store(monkeypatch):
    monkeypatch.setenv("AFD_CLUSTER_TOKEN", "hang")
    port = free_ports(1)[0]
    server = ControlServer("127.0.0.1", port, workers=8)
    yield ControlStore(f"127.0.0.1:{port}", 20), f"127.0.0.1:{port}"
    server.stop(0)


@pytest.mark.multiprocess
def test_a_hung_peers_wait_ends_at_the_abort_and_other_pairs_go_on(store):
    store, address = store
    other_attn, other_ffn = _form(store, "attn1@i0-ffn0@i0")  # a second pair of this process, both ends here
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    peer = subprocess.Popen(
        [sys.executable, "-c", _PEER, address], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    try:
        link = PairLink(get_backend("cpu"), store, "attn0@i0-ffn0@i0", FFN, 20)
        assert all(g.connections for g in (link.to_ffn, link.to_attention)), "each group found its connections"
        assert not link.to_ffn.connections & link.to_attention.connections
        plane = DataPlane(get_backend("cpu"), 1, timeout_s=60)  # gloo's own timeout far past the bound
        plane.add(0, link)
        got = torch.empty(4)
        plane.wait(plane.irecv(got, 0), 0, "step header receive")
        plane.wait(plane.isend(got * 2, 0), 0, "output send")
        assert peer.stdout.readline().strip() == "exchanged 6.0"
        while not _stopped(peer.pid):
            time.sleep(0.01)
        stopped = time.monotonic()
        pending = plane.irecv(torch.empty(4), 0)  # never sent: the peer hangs
        waited = []

        def verdict() -> None:  # the heartbeat's, from another thread, as abort_lost_peers gives it
            waited.append(plane.waiting_on(0))
            plane.abort(0, "the peer missed its heartbeats")

        threading.Timer(ABORT_S, verdict).start()
        with pytest.raises(PeerError, match="its pair was aborted .the peer missed its heartbeats"):
            plane.wait(pending, 0, "step header receive")
        ended = time.monotonic() - stopped
        assert ended <= ABORT_S + BOUND_S, f"the wait ended {ended:.2f}s after the peer stopped"
        assert 0.8 * ABORT_S <= waited[0] <= ended, "waiting_on says how long this end has waited on the peer"
        assert plane.waiting_on(0) == 0.0
        assert _round_trip(other_attn, other_ffn, 4.0) == 8.0, "the other pair of this process is untouched"
        store.set("still", "answers")
        assert store.get("still") == b"answers"
        os.kill(peer.pid, signal.SIGCONT)
        assert peer.stdout.readline().startswith("receive: failed"), "the peer, once continued, sees its pair gone"
        assert peer.wait(30) == 0
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"
