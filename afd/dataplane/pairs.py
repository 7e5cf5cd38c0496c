"""One attention–FFN pair's own two-rank world: the building block for a data plane without a global
world (issue 26: a replaced node forms its own pairs while the others keep stepping).

Today's DataPlane (afd/dataplane/transport.py) makes every pair's groups inside one torch.distributed world
over every rank, so a replaced node makes every node re-form that world (a generation). A PairLink is two
standalone groups (`Backend.pair_group`: one per direction, for the reason transport.py's docstring gives)
over their own store prefix, keyed by the pair's two instances (attention instance id, FFN instance id): no
default group, no other process takes part, and a replaced node's pair gets fresh keys. Rank 0 is the
attention side, rank 1 the FFN side. Not wired into DataPlane yet.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from afd.backend import Backend

ATTENTION, FFN = 0, 1


class PairLink:
    def __init__(self, backend: Backend, store, key: str, rank: int, timeout_s: float):
        """store: the rendezvous store (afd.dataplane.rendezvous.ControlStore), which the caller keeps
        referenced while the link lives; key: the pair instance's, e.g. f"{attention_id}-{ffn_id}"."""
        assert rank in (ATTENTION, FFN)
        self.backend, self.rank, self.peer, self.key = backend, rank, 1 - rank, key
        timeout = timedelta(seconds=timeout_s)
        # formed in one order on both ends: a gloo group's constructor blocks until the peer's connects
        self._stores = [dist.PrefixStore(f"afd/pair/{key}/{d}/", store) for d in ("to-ffn", "to-attention")]
        self.to_ffn, self.to_attention = (backend.pair_group(s, rank, timeout) for s in self._stores)

    def isend(self, tensor: torch.Tensor):
        group = self.to_ffn if self.rank == ATTENTION else self.to_attention
        return group.send([tensor], self.peer, 0)

    def irecv(self, tensor: torch.Tensor):
        group = self.to_attention if self.rank == ATTENTION else self.to_ffn
        return group.recv([tensor], self.peer, 0)

    def abort(self) -> None:
        """Both directions' communicators, without waiting for queued work (Backend.abort_group)."""
        for group in (self.to_ffn, self.to_attention):
            self.backend.abort_group(group)
