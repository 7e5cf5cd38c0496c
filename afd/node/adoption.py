"""Bringing a dead FFN node's replacement back while the attention rank keeps serving.

Under layout.routing attention, a re-formation after an FFN node's loss leaves that node out when the
pairs formed serve every routed expert (replicas: afd.node.pairing.form_pairs with `covered`); requests go
on at once. `Adopter` then tries the left-out nodes' pairs on a thread of its own, and the engine thread
takes each pair formed into its plane and exchange at a step boundary (`take`), so the replacement gets
its tokens back without a pause for anyone.
"""

from __future__ import annotations

import logging
import queue
import threading

from afd.control import control_pb2 as pb
from afd.dataplane.pairs import PairLink
from afd.node.pairing import FFNPeer, try_pair

log = logging.getLogger("afd.node")
RETRY_S = 0.5


class Adopter:
    """Forms the pairs of `peers` (left out of the last re-formation) in the background."""

    def __init__(self, peers: list[FFNPeer], me: pb.NodeRef, my_rank: int, backend, stop: threading.Event):
        self.formed: queue.SimpleQueue[tuple[FFNPeer, PairLink]] = queue.SimpleQueue()
        self._peers, self._me, self._rank, self._backend = list(peers), me, my_rank, backend
        self._stop = threading.Event()
        self._cluster_stop = stop
        self._thread = threading.Thread(target=self._run, name="afd-adopt", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._backend.bind_thread()
        waiting = list(self._peers)
        while waiting and not self._stop.is_set() and not self._cluster_stop.is_set():
            for peer in list(waiting):
                try:
                    link, why = try_pair(peer, self._me, self._rank, self._backend)
                except Exception as e:  # refused for good: today's rejoin path will say so at the next failure
                    log.error("FFN node %s will not form a pair again: %s", peer.name, e)
                    waiting.remove(peer)
                    continue
                if self._stop.is_set():  # a re-formation began meanwhile: this pair is not its to adopt
                    if link is not None:
                        link.close(queued=True)
                    return
                if link is not None:
                    log.info("FFN node %s is back: its pair formed, adopted at the next step", peer.name)
                    self.formed.put((peer, link))
                    waiting.remove(peer)
            self._stop.wait(RETRY_S)

    def take(self) -> list[tuple[FFNPeer, PairLink]]:
        """The pairs formed since the last call (engine thread, at a step boundary)."""
        out = []
        while True:
            try:
                out.append(self.formed.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> list[tuple[FFNPeer, PairLink]]:
        """Stops trying (a re-formation takes over); returns pairs formed but not taken, for the caller to close."""
        self._stop.set()
        self._thread.join(timeout=15)
        return self.take()
