"""The FFN node's receives of a micro-batch's rows: every peer's rows into one buffer, peer by peer, posted
ahead where the transport allows, and a failed peer's rows zeroed."""

from __future__ import annotations

from collections.abc import Callable

import torch

from afd.backend import Backend
from afd.dataplane.buffers import BufferPool
from afd.dataplane.prefetch import PrefetchSchedule
from afd.dataplane.protocol import packed_width
from ffn_node.peers import FAILED, PeerRows, Peers, Transfer


class Receives:
    """Receive buffers (`pool`, and `packed` for quantized or routed rows) and the receives posted into them."""

    def __init__(
        self,
        peers: Peers,
        backend: Backend,
        hidden: int,
        dtype: torch.dtype,
        exchange_dtype: str,
        routing: str,
        prefetch: PrefetchSchedule | None,
        model_cfg,
    ):
        """model_cfg: the FFN half's (its moe_layers: where the prefetch measures its gap)."""
        self.peers, self.backend, self.hidden = peers, backend, hidden
        self.exchange_dtype, self.routing, self.prefetch, self.cfg = exchange_dtype, routing, prefetch, model_cfg
        self.pool = BufferPool(backend.device, dtype)
        self.packed = None if exchange_dtype == "same" and routing == "ffn" else BufferPool(backend.device, torch.uint8)
        """Receive buffers of quantized MoE inputs (uint8 rows: bits, then the scale), dequantized into `pool`'s."""

    def post_ahead(
        self, rest: list[tuple[int, int]], i: int, parts_of: Callable[[int, int], list[PeerRows]]
    ) -> tuple | None:
        """Posts the next micro-batch's receives before micro-batch `i` computes, where a receive posted is only a
        buffer registered (gloo: the host waits, and its transport thread reads the bytes): under ping-pong
        the attention rank sends micro-batch i + 1 while this node computes i, and gloo sends a message's bytes
        only once its receive is posted (gloo/transport/tcp/pair.cc: the send and receive notices), so a
        receive posted late costs a round of notices and thread wake-ups per message. Not on NCCL/HCCL, whose
        receive would be a kernel on the pair's stream ahead of micro-batch i's result sends; not under routing
        attention, whose rows' size comes in a count first; not into the buffer micro-batch `i` still reads.
        rest: the (layer, micro-batch) still to run; returns (layer, j, parts, post(j, parts)) or None."""
        if self.routing == "attention" or self.backend.stream_ordered_waits:
            return None
        for layer, j in rest:
            parts = parts_of(layer, j)
            if parts:
                return (layer, j, parts, self.post(j, parts)) if j != i else None
        return None

    def post(self, i: int, parts: list[PeerRows]) -> tuple[torch.Tensor, list[Transfer]]:
        """Every peer's receive of micro-batch i's rows, peer by peer, into one buffer (`pool`'s, or `packed`'s):
        (the buffer [T_all, H or the packed width], the receives)."""
        total = sum(p.rows for p in parts)
        x = self.pool.get(i, total, self.hidden)  # [T_all, H]: every peer's tokens, peer by peer
        if self.packed is not None:
            x = self.packed.get(i, total, packed_width(self.hidden, self.exchange_dtype))
        return x, self.post_into(x, parts)

    def post_into(self, x: torch.Tensor, parts: list[PeerRows]) -> list[Transfer]:
        """Each peer's receive of its rows into `x`, peer by peer."""
        recvs, off = [], 0
        for p in parts:
            recvs.append(
                Transfer(p.peer, off, p.rows, self.peers.post(self.peers.plane.irecv, x[off : off + p.rows], p.peer))
            )
            off += p.rows
        return recvs

    def receive(self, layer: int, i: int, x: torch.Tensor, recvs: list[Transfer]):
        """Waits for the posted receives of the micro-batch's rows into `x`; its rows and the prefetch's gap, a
        failed peer's rows zeroed."""
        gap = None
        if self.prefetch is not None and i == 0 and layer in self.cfg.moe_layers:  # once per layer
            gap = self.prefetch.in_gap(
                layer, lambda: all(t.work is not FAILED and t.work.is_completed() for t in recvs)
            )
        ok = self.peers.wait_all(recvs, f"layer {layer} MoE input receive")
        if len(ok) < len(recvs):
            x = self._without_failed(i, x, ok)
        return x, gap

    def _without_failed(self, i: int, x: torch.Tensor, ok: list[Transfer]) -> torch.Tensor:
        """The micro-batch's input with a failed peer's rows zeroed (computed and thrown away, never read
        uninitialised), in new memory: the failed receive may still sit on its stream after the abort and
        write into the pool's buffer, so that buffer is retired rather than written or used again."""
        clean = torch.zeros(x.shape, dtype=x.dtype, device=x.device)  # not zeros_like: the fake NPU counts x as read
        for t in ok:
            clean[t.offset : t.offset + t.rows].copy_(x[t.offset : t.offset + t.rows])
        self.peers.retire((self.pool if self.packed is None else self.packed).retire(i))
        return clean
