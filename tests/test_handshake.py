"""The data-plane handshake (afd.dataplane.pairs.handshake), between the two real processes of a pair over
gloo: only holders of the cluster token get past it."""

from __future__ import annotations

import pytest
from cluster_helpers import free_ports
from rank_processes import context


def _member(rank: int, port: int, token: str | None, out) -> None:
    from afd.backend import get_backend
    from afd.dataplane.pairs import PairLink, handshake
    from afd.dataplane.rendezvous import rendezvous_store
    from afd.dataplane.transport import PeerError

    store, server = rendezvous_store(rank, "127.0.0.1", port, 20)
    link = PairLink(get_backend("cpu"), store, "attn0-ffn0-f0", rank, 20)  # rank 0: the attention end
    try:
        handshake(link, token, 20)
        out.put((rank, "ok"))
    except PeerError as e:
        out.put((rank, str(e)))
    link.close(queued=False)


REFUSED = {0: "the ffn end of the pair failed the handshake", 1: "the attention end of the pair failed the handshake"}


@pytest.mark.parametrize(
    "tokens,expect",
    [
        (("secret", "secret"), {0: "ok", 1: "ok"}),
        (("secret", "forged"), REFUSED),
        (("secret", None), REFUSED),  # a process without the token, which knows the pair's key
    ],
    ids=["token", "forged", "no-token"],
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
        assert text in got[r], got
