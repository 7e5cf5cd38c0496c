"""The FFN node's inputs under layout.routing attention (afd.dataplane.protocol): each attention peer first
sends how many of its rows come here, then those rows with their expert ids and weights; the experts alone
then run on every peer's rows together (the router ran on the attention side)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd.backend import host_syncs
from afd.dataplane.protocol import dequantize, hidden_bytes, row_bytes, unpack_rows
from ffn_node.peers import PeerRows, Peers
from ffn_node.receives import Receives


@dataclass(frozen=True)
class RoutedInput:
    """A micro-batch's routed rows, every peer's together, peer by peer."""

    x: torch.Tensor
    """[T, H] in the model dtype."""
    ids: torch.Tensor
    """[T, K] each row's experts held here (-1: held elsewhere)."""
    weights: torch.Tensor
    """[T, K] their routing weights (0 where held elsewhere)."""
    rows: list[PeerRows]
    gap: float | None
    """The prefetch's gap (afd.dataplane.prefetch)."""


class RoutedRows:
    def __init__(self, peers: Peers, receives: Receives, experts_per_token: int):
        self.peers, self.receives, self.K = peers, receives, experts_per_token

    def receive(self, layer: int, i: int, parts: list[PeerRows]) -> RoutedInput | None:
        """parts: each peer's tokens in this micro-batch. None when no row came here."""
        peers, rx = self.peers, self.receives
        counted = []
        for p in parts:
            buf = peers.counts.setdefault(p.peer, torch.empty(1, dtype=torch.int64, device=rx.backend.device))
            counted.append((p, peers.post(peers.plane.irecv, buf, p.peer)))
        got = [p for p, w in counted if peers.wait(w, p.peer, f"layer {layer} MoE count receive")]
        rows = [p for p in self._read_counts(got) if p.rows > 0]
        if not rows:
            return None
        total, dtype = sum(p.rows for p in rows), rx.pool.dtype
        assert rx.packed is not None  # routed rows always arrive packed
        packed = rx.packed.get(i, total, row_bytes(rx.hidden, dtype, self.K, rx.exchange_dtype))
        packed, gap = rx.receive(layer, i, packed, rx.post_into(packed, rows))
        xb, ids, weights = unpack_rows(packed, hidden_bytes(rx.hidden, dtype, rx.exchange_dtype), self.K)
        if rx.exchange_dtype == "same":
            x = xb.contiguous().view(dtype)
        else:
            x = dequantize(xb, rx.exchange_dtype, rx.pool.get(i, total, rx.hidden))
        return RoutedInput(x, ids, weights, rows, gap)

    def _read_counts(self, got: list[PeerRows]) -> list[PeerRows]:
        """The rows each peer whose count arrived sends here, read on the host at once (`got`: its tokens in the
        micro-batch); a count beyond the peer's tokens is a broken peer's: dropped, never a size to allocate."""
        if not got:
            return []
        values = host_syncs.to_list(torch.cat([self.peers.counts[p.peer] for p in got]))
        out = []
        for p, n in zip(got, values):
            if not 0 <= n <= p.rows:
                self.peers.drop(
                    p.peer, f"data plane: rank {p.peer} sent a row count of {n} for {p.rows} tokens", abort=True
                )
                continue
            out.append(PeerRows(p.peer, n))
        return out
