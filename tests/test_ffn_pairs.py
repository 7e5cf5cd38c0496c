"""The FFN node's side of forming pairs (ffn_node/pairs.py), in process: a node's TP ranks are handed to the
serving loop together, and a pair its rank superseded before the loop took it is closed, never adopted."""

from __future__ import annotations

from cluster_helpers import cluster_yaml

from afd.config.loader import load
from ffn_node.pairs import PairAcceptor
from ffn_node.peers import FormedPair


class _Link:
    def __init__(self, key: str):
        self.key, self.closed = key, None

    def close(self, queued: bool) -> None:
        self.closed = queued


def _acceptor(tmp_path, tiny_checkpoint) -> PairAcceptor:
    cfg = load(str(cluster_yaml(tmp_path, tiny_checkpoint, 1, 1, layout={"attention_tp": 2})))
    return PairAcceptor(cfg, "ffn0")  # ranks: attn0 0, attn0.tp1 1, ffn0 2


def _asked(acc: PairAcceptor, rank: int, key: str) -> _Link:
    acc._asked[rank] = key  # what FormPair records before it starts the formation
    return _Link(key)


def test_a_node_s_ranks_are_handed_over_together(tmp_path, tiny_checkpoint):
    acc = _acceptor(tmp_path, tiny_checkpoint)
    a = _asked(acc, 0, "a")
    acc._hold([FormedPair(0, "attn0", a)])
    assert acc.formed.empty(), "rank 0 alone: the loop would wait for a header rank 0 sends only after rank 1's"
    b = _asked(acc, 1, "b")
    acc._hold([FormedPair(1, "attn0.tp1", b)])
    group = acc.formed.get_nowait()
    assert group == [FormedPair(0, "attn0", a), FormedPair(1, "attn0.tp1", b)] and acc.current(group)


def test_a_pair_superseded_before_adoption_is_closed_and_the_node_waits_for_the_new_one(tmp_path, tiny_checkpoint):
    acc = _acceptor(tmp_path, tiny_checkpoint)
    old0, b = _asked(acc, 0, "a"), _asked(acc, 1, "b")
    acc._hold([FormedPair(0, "attn0", old0)])
    acc._hold([FormedPair(1, "attn0.tp1", b)])
    group = acc.formed.get_nowait()
    new0 = _asked(acc, 0, "a2")  # rank 0 asked again after its first pair formed, before the loop took it
    assert not acc.current(group)
    assert old0.closed is True and b.closed is None, "only the superseded pair goes (aborted: its end is gone)"
    assert acc.formed.empty(), "rank 1's pair waits for rank 0's new one"
    acc._hold([FormedPair(0, "attn0", new0)])
    group = acc.formed.get_nowait()
    assert group == [FormedPair(0, "attn0", new0), FormedPair(1, "attn0.tp1", b)] and acc.current(group)


def test_a_rank_that_asks_again_before_its_node_completes_replaces_its_pair(tmp_path, tiny_checkpoint):
    acc = _acceptor(tmp_path, tiny_checkpoint)
    first = _asked(acc, 0, "a")
    acc._hold([FormedPair(0, "attn0", first)])
    second = _asked(acc, 0, "a2")
    acc._hold([FormedPair(0, "attn0", second)])
    assert first.closed is True and acc.formed.empty()
    b = _asked(acc, 1, "b")
    acc._hold([FormedPair(1, "attn0.tp1", b)])
    assert acc.formed.get_nowait() == [FormedPair(0, "attn0", second), FormedPair(1, "attn0.tp1", b)]
