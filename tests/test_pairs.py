"""Per-pair worlds on gloo (afd.dataplane.pairs): each attention–FFN pair forms its own two-rank world
through the authenticated rendezvous store, proves the cluster token over it (the handshake), and one pair
re-forming (a replaced attention node) leaves another pair of the same FFN node exchanging throughout: on
the links themselves, and on a DataPlane that replaces the pair with add()."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from cluster_helpers import free_ports

from afd.backend import get_backend
from afd.control.server import ControlServer
from afd.dataplane.pairs import ATTENTION, FFN, PairLink, handshake
from afd.dataplane.rendezvous import ControlStore
from afd.dataplane.transport import DataPlane, PeerError


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


def _handshake(a: PairLink, f: PairLink, tokens: tuple[str | None, str | None], timeout_s: float = 20) -> list:
    """Both ends' handshakes at once; each end's outcome: "ok" or its PeerError's text."""

    def one(link: PairLink, token: str | None) -> str:
        try:
            handshake(link, token, timeout_s)
            return "ok"
        except PeerError as e:
            return str(e)

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, (a, f), tokens))


def test_the_handshake_over_a_pair_passes_token_holders_and_holds_its_deadline(store):
    a, f = _form(store, "attn0@i0-ffn0@i0")
    assert _handshake(a, f, ("pairs", "pairs")) == ["ok", "ok"]
    assert _round_trip(a, f, 2.0) == 4.0, "the pair carries tensors after its handshake"
    a, f = _form(store, "attn0@i1-ffn0@i0")
    got = _handshake(a, f, ("pairs", None))  # an end without the token, which knows the pair's key
    assert "the ffn end of the pair failed the handshake" in got[0], got
    assert "the attention end of the pair failed the handshake" in got[1], got
    a, f = _form(store, "attn0@i2-ffn0@i0")
    t0 = time.monotonic()
    with pytest.raises(PeerError, match="handshake"):
        handshake(a, "pairs", 1)  # the FFN end never answers
    assert time.monotonic() - t0 < 5, "the handshake's 1 s deadline did not hold"


def test_a_data_plane_replaces_one_pair_while_another_keeps_exchanging(store):
    """The FFN node's DataPlane (rank 2) with two attention peers (0, 1). Attention rank 0 forms a new pair
    (its replacement): the old one is aborted from another thread (as the Pairs service does when a rank
    asks again), the new one forms and handshakes on threads of its own, and the owner thread adds it at a
    step boundary, exchanging with rank 1 throughout and never waiting for the formation."""
    cpu = get_backend("cpu")
    ffn = DataPlane(cpu, 2, timeout_s=20)
    attn = {r: DataPlane(cpu, r, timeout_s=20) for r in (0, 1)}
    for r in (0, 1):
        a, f = _form(store, f"attn{r}@i0-ffn0@i0")
        assert _handshake(a, f, ("pairs", "pairs")) == ["ok", "ok"]
        attn[r].add(2, a)
        ffn.add(r, f)

    def step(r: int, value: float) -> float:  # one round trip over the planes: header out, answer back
        x, got, back = torch.full((4,), value), torch.empty(4), torch.empty(4)
        w = [(attn[r], attn[r].isend(x, 2), 2), (ffn, ffn.irecv(got, r), r)]
        for plane, work, peer in w:
            plane.wait(work, peer, "step")
        w = [(ffn, ffn.isend(got * 2, r), r), (attn[r], attn[r].irecv(back, 2), 2)]
        for plane, work, peer in w:
            plane.wait(work, peer, "answer")
        return float(back[0])

    assert step(0, 1.0) == 2.0 and step(1, 1.0) == 2.0
    formed: queue.SimpleQueue = queue.SimpleQueue()
    rounds: list[tuple[float, float]] = []
    after: list[float] = []
    stop = threading.Event()

    def owner() -> None:  # the FFN node's serving loop (and, for the test, the attention ends' ops)
        while not stop.is_set():
            try:
                a, f = formed.get_nowait()
            except queue.Empty:
                pass
            else:  # the step boundary: the new pair in place of the old
                attn[0].add(2, a)
                ffn.add(0, f)
                after.append(step(0, 4.0))
            rounds.append((time.monotonic(), step(1, 5.0)))

    t = threading.Thread(target=owner)
    t.start()
    try:
        old = ffn.link(0)
        abort = threading.Thread(target=ffn.abort_link, args=(0, old, "attn0 forms a new pair"))
        abort.start()
        abort.join()
        assert ffn.aborted(0) and not ffn.aborted(1)
        t0 = time.monotonic()
        a, f = _form(store, "attn0@i1-ffn0@i0")
        assert _handshake(a, f, ("pairs", "pairs")) == ["ok", "ok"]
        formed_at = time.monotonic()
        formed.put((a, f))
        end = time.monotonic() + 20
        while not after and time.monotonic() < end:
            time.sleep(0.05)
        ffn.abort_link(0, old, "a late abort of the old pair")  # a pair formed since stays
    finally:
        stop.set()
        t.join(30)
    assert after == [8.0], "the new pair did not exchange"
    assert not ffn.aborted(0) and ffn.link(0) is f
    assert all(v == 10.0 for _, v in rounds)
    during = [ts for ts, _ in rounds if t0 <= ts <= formed_at]
    assert during, "rank 1's pair made no exchange while rank 0's pair formed"
    assert step(0, 6.0) == 12.0 and step(1, 6.0) == 12.0
    for plane in (ffn, *attn.values()):
        plane.close()
    assert ffn.peers == []
