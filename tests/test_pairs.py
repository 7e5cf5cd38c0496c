"""Per-pair worlds on gloo (afd.dataplane.pairs): each attention–FFN pair forms its own two-rank world
through the authenticated rendezvous store, and one pair re-forming (a replaced attention node) leaves
another pair of the same FFN node exchanging throughout."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from cluster_helpers import free_ports

from afd.backend import get_backend
from afd.control.server import ControlServer
from afd.dataplane.pairs import ATTENTION, FFN, PairLink
from afd.dataplane.rendezvous import ControlStore


@pytest.fixture
def store(monkeypatch):
    monkeypatch.setenv("AFD_CLUSTER_TOKEN", "pairs")
    port = free_ports(1)[0]
    server = ControlServer("127.0.0.1", port, workers=8)
    s = ControlStore(f"127.0.0.1:{port}", 20)  # referenced for as long as the groups may use it
    yield s
    server.stop(0)


def _form(store, key: str) -> tuple[PairLink, PairLink]:
    cpu = get_backend("cpu")
    with ThreadPoolExecutor(2) as pool:
        a, f = (pool.submit(PairLink, cpu, store, key, r, 20) for r in (ATTENTION, FFN))
        return a.result(), f.result()


def _round_trip(a: PairLink, f: PairLink, value: float) -> float:
    x, got, y, back = torch.full((4,), value), torch.empty(4), None, torch.empty(4)
    w = [a.isend(x), f.irecv(got)]
    for work in w:
        work.wait()
    y = got * 2
    w = [f.isend(y), a.irecv(back)]
    for work in w:
        work.wait()
    return float(back[0])


def test_pairs_form_alone_and_one_re_forms_while_the_other_exchanges(store):
    b_attn, b_ffn = _form(store, "attn1@i0-ffn0@i0")
    assert _round_trip(b_attn, b_ffn, 1.0) == 2.0
    a_attn, a_ffn = _form(store, "attn0@i0-ffn0@i0")
    assert _round_trip(a_attn, a_ffn, 3.0) == 6.0

    rounds, stop = [], threading.Event()

    def keep_exchanging() -> None:  # the other pair, stepping throughout
        while not stop.is_set():
            rounds.append((time.monotonic(), _round_trip(b_attn, b_ffn, 5.0)))

    t = threading.Thread(target=keep_exchanging)
    t.start()
    try:
        a_attn.abort()
        a_ffn.abort()
        t0 = time.monotonic()
        a_attn, a_ffn = _form(store, "attn0@i1-ffn0@i0")  # attn0's new instance: fresh keys, its pair only
        formed = time.monotonic()
        assert _round_trip(a_attn, a_ffn, 7.0) == 14.0
        time.sleep(0.2)
    finally:
        stop.set()
        t.join(30)
    assert all(v == 10.0 for _, v in rounds)
    during = [ts for ts, _ in rounds if t0 <= ts <= formed + 0.2]
    assert during, "the other pair made no exchange while attn0's pair re-formed"
