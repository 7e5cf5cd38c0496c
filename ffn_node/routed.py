"""The FFN server's micro-batch under layout.routing attention (afd.dataplane.protocol): each attention peer
first sends how many of its rows come here, then those rows with their expert ids and weights; the experts
alone run on every peer's rows together (the router ran on the attention side)."""

from __future__ import annotations

import torch

from afd.backend import host_syncs
from afd.dataplane.protocol import dequantize, hidden_bytes, row_bytes, unpack_rows


class RoutedRows:
    """Mixed into ffn_node.server.FFNServer, whose peer bookkeeping (_post, _wait, _drop), buffers, receive
    and accounting it uses."""

    def _run_routed(self, layer: int, i: int, parts: list[tuple[int, int]]):
        """parts: (peer, its tokens in this micro-batch). Returns (y, sends) as _run_micro_batch does; (None,
        sends) when no row came."""
        recvs = []
        for r, _ in parts:
            buf = self._counts.setdefault(r, torch.empty(1, dtype=torch.int64, device=self.backend.device))
            recvs.append((r, self._post(self.plane.irecv, buf, r)))
        got = [(r, n) for (r, w), (_, n) in zip(recvs, parts) if self._wait(w, r, f"layer {layer} MoE count receive")]
        rows = [(r, n) for r, n in self._read_counts(got) if n > 0]
        if not rows:
            return None, []
        total = sum(n for _, n in rows)
        K = self.ffn.cfg.experts_per_token
        dtype = self.pool.dtype
        packed = self.packed.get(i, total, row_bytes(self.hidden, dtype, K, self.exchange_dtype))
        packed, gap = self._receive(layer, i, packed, self._post_into(packed, rows))
        xb, ids, weights = unpack_rows(packed, hidden_bytes(self.hidden, dtype, self.exchange_dtype), K)
        if self.exchange_dtype == "same":
            x = xb.contiguous().view(dtype)
        else:
            x = dequantize(xb, self.exchange_dtype, self.pool.get(i, total, self.hidden))
        self.time.idle(layer)
        with torch.inference_mode():
            y = self.time.compute(layer, gap, lambda: self.ffn.routed(self.backend, layer, x, weights, ids))
        return self._after_compute(layer, total, rows, y)

    def _read_counts(self, got: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """(peer, rows it sends here) for the peers whose count arrived, read on the host at once; a count
        beyond the peer's tokens in the micro-batch (its header's) is a broken peer's: dropped, never a size
        to allocate."""
        if not got:
            return []
        values = host_syncs.to_list(torch.cat([self._counts[r] for r, _ in got]))
        out = []
        for (r, tokens), n in zip(got, values):
            if not 0 <= n <= tokens:
                self._drop(r, f"data plane: rank {r} sent a row count of {n} for {tokens} tokens", abort=True)
                continue
            out.append((r, n))
        return out
