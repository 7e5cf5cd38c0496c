"""The data-plane handshake, between two real processes over gloo: only holders of the cluster token
get past it."""

from __future__ import annotations

import pytest
from cluster_helpers import free_ports
from rank_processes import context


def _member(rank: int, port: int, token: str, out) -> None:
    from afd.backend import get_backend
    from afd.dataplane.rendezvous import rendezvous_store
    from afd.dataplane.transport import DataPlane, PeerError

    store, server = rendezvous_store(rank, "127.0.0.1", port, 20)
    plane = DataPlane(get_backend("cpu"), rank, 2, store, 0, 20, "f0", "127.0.0.1")
    try:
        plane.handshake([1 - rank], token, "f0")
        out.put((rank, "ok"))
    except PeerError as e:
        out.put((rank, str(e)))
    plane.close()


@pytest.mark.parametrize(
    "tokens,expect",
    [
        (("secret", "secret"), {0: "ok", 1: "ok"}),
        (("secret", "forged"), {0: "rank 1 failed the handshake", 1: "rank 0 failed the handshake"}),
    ],
)
def test_only_token_holders_pass_the_handshake(tokens, expect):
    ctx = context()  # forked from a server that has torch imported (tests/rank_processes.py)
    out = ctx.Queue()
    port = free_ports(1)[0]
    procs = [ctx.Process(target=_member, args=(r, port, tokens[r], out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    for r, text in expect.items():
        assert text in got[r]
