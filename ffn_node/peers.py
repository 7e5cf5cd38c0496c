"""The attention ranks an FFN node serves, and their records: which peers are live, posting to and waiting on
one, and dropping one that fails so that the others are served on. The serving loop (ffn_node/server.py), its
receives (ffn_node/receives.py) and the routed rows (ffn_node/routed.py) all go through one Peers."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from afd.dataplane.protocol import HEADER_LEN
from afd.dataplane.transport import DataPlane, PeerError

log = logging.getLogger("afd.ffn")

FAILED = object()
"""What Peers.post hands back for an op that could not be posted (its peer is dropped)."""
RETIRED_KEPT = 64
"""Buffers a failed peer's aborted transfer may still touch, kept from reuse (the oldest go first)."""


@dataclass(frozen=True, slots=True)
class FormedPair:
    """A pair an attention rank formed with this node (ffn_node/pairs.py), to be taken into use."""

    rank: int
    name: str
    """The rank's process name (attn0, attn0.tp1)."""
    link: Any
    """Its afd.dataplane.pairs.PairLink."""


@dataclass(frozen=True, slots=True)
class PeerRows:
    """One attention peer's rows in a micro-batch that come to this node."""

    peer: int
    rows: int


@dataclass(frozen=True, slots=True)
class Transfer:
    """A posted op on one peer's rows, at `offset` in the micro-batch's buffer (FAILED: not posted)."""

    peer: int
    offset: int
    rows: int
    work: Any


class Peers:
    """The live attention peers (`active`, in the order they joined), the ones that failed and have not formed
    a pair again (`gone`, with why), the ones that left for good (`left`), and each one's header buffer and
    next step id."""

    def __init__(self, plane: DataPlane, device: torch.device):
        self.plane, self.device = plane, device
        self.active: list[int] = []
        self.names: dict[int, str] = {}
        self.gone: dict[int, str] = {}
        """Peers that failed and have not formed a pair again, and why."""
        self.left: set[int] = set()
        """Peers that left for good (their engine stopped)."""
        self.headers: dict[int, torch.Tensor] = {}
        self.next_step: dict[int, int] = {}
        """The step id each peer's next header must carry (idle and leave headers repeat it)."""
        self.counts: dict[int, torch.Tensor] = {}
        """Per peer, the receive buffer of its row count (routing attention)."""
        self._retired: deque[torch.Tensor] = deque(maxlen=RETIRED_KEPT)

    def take(self, pair: FormedPair) -> None:
        """A pair taken into use at a step boundary, in place of the rank's old one (if any)."""
        r = pair.rank
        again = r in self.gone or r in self.active
        if r in self.active:
            self.active.remove(r)
        self.plane.add(r, pair.link)  # the old pair, if any, goes (aborted where its work may be queued)
        self.gone.pop(r, None)
        self.left.discard(r)
        self.active.append(r)
        self.names[r] = pair.name
        self.next_step[r] = 0
        if r in self.counts:  # like the header's: the old pair's receive may still write into it
            self.retire(self.counts.pop(r))
        if r in self.headers:  # the old pair's receive into it may have been aborted, not finished
            self.retire(self.headers[r])
        self.headers[r] = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        log.info(
            "attention rank %d (%s) %s; serving %d peer(s)",
            r,
            pair.name,
            "formed its pair again" if again else "joined",
            len(self.active),
        )

    def leave(self, r: int) -> None:
        log.info("attention rank %d (%s) left", r, self.names[r])
        self.active.remove(r)
        self.left.add(r)
        self.plane.drop(r)

    def drop(self, r: int, why: str, level: int = logging.WARNING, abort: bool = False) -> None:
        """abort: the peer is alive but broke the protocol; its pair is aborted, so that nothing it still
        sends stays queued for a teardown to wait on."""
        if abort:
            self.plane.abort(r)
        if r in self.active:
            self.active.remove(r)
            self.gone[r] = why
            log.log(
                level,
                "attention rank %d (%s) dropped: %s; serving %d other(s)",
                r,
                self.names.get(r, "?"),
                why,
                len(self.active),
            )

    def fail(self, r: int, e: PeerError) -> None:
        self.drop(r, str(e))  # the data plane aborted the pair; the other peers' pairs are untouched

    def post(self, op, tensor: torch.Tensor, r: int):
        """isend/irecv to a live peer; FAILED (and the peer dropped) when it is gone."""
        if r not in self.active:
            return FAILED
        try:
            return op(tensor, r)
        except PeerError as e:
            self.fail(r, e)
            return FAILED

    def wait(self, work, r: int, what: str) -> bool:
        if work is FAILED or r not in self.active:
            return False
        try:
            self.plane.wait(work, r, what)
            return True
        except PeerError as e:
            self.fail(r, e)
            return False

    def wait_all(self, transfers: list[Transfer], what: str) -> list[Transfer]:
        """Waits for each transfer; the ones that completed (a failed one's peer is dropped)."""
        return [t for t in transfers if self.wait(t.work, t.peer, what)]

    def retire(self, t: torch.Tensor) -> None:
        """A tensor a failed peer's send may still read (an aborted transfer may stay on its stream): kept
        from reuse, so that its memory is not written again while it might be read (or, a receive buffer,
        written by a failed peer's receive while it is read for another); the last RETIRED_KEPT of them."""
        self._retired.append(t)
