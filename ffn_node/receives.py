"""The FFN server's receives of a micro-batch's rows (mixed into ffn_node.server.FFNServer): every peer's rows
into one buffer, peer by peer, posted ahead where the transport allows, and a failed peer's rows zeroed."""

from __future__ import annotations

import torch

from afd.dataplane.protocol import packed_width

FAILED = object()
"""What FFNServer._post hands back for an op that could not be posted (its peer is dropped)."""


class Receives:
    """Uses FFNServer's peers (_post, _wait, _retire), buffers (pool, packed), plane, backend and prefetch."""

    def _post_ahead(self, rest: list[tuple[int, int]], i: int, parts_of) -> tuple | None:
        """Posts the next micro-batch's receives before micro-batch `i` computes, where a receive posted is only a
        buffer registered (gloo: the host waits, and its transport thread reads the bytes): under ping-pong
        the attention rank sends micro-batch i + 1 while this node computes i, and gloo sends a message's bytes
        only once its receive is posted (gloo/transport/tcp/pair.cc: the send and receive notices), so a
        receive posted late costs a round of notices and thread wake-ups per message. Not on NCCL/HCCL, whose
        receive would be a kernel on the pair's stream ahead of micro-batch i's result sends; not under routing
        attention, whose rows' size comes in a count first; not into the buffer micro-batch `i` still reads."""
        if self.routing == "attention" or self.backend.stream_ordered_waits:
            return None
        for layer, j in rest:
            parts = parts_of(layer, j)
            if parts:
                return (layer, j, parts, self._post_inputs(j, parts)) if j != i else None
        return None

    def _post_inputs(self, i: int, parts: list[tuple[int, int]]) -> tuple[torch.Tensor, list]:
        """Every peer's receive of micro-batch i's rows, peer by peer, into one buffer (`pool`'s, or `packed`'s):
        (the buffer [T_all, H or the packed width], [(peer, offset, rows, work)])."""
        total = sum(n for _, n in parts)
        x = self.pool.get(i, total, self.hidden)  # [T_all, H]: every peer's tokens, peer by peer
        if self.packed is not None:
            x = self.packed.get(i, total, packed_width(self.hidden, self.exchange_dtype))
        return x, self._post_into(x, parts)

    def _post_into(self, x: torch.Tensor, parts: list[tuple[int, int]]) -> list:
        """Each peer's receive of its rows into `x`, peer by peer: [(peer, offset, rows, work)]."""
        recvs, off = [], 0
        for r, n in parts:
            recvs.append((r, off, n, self._post(self.plane.irecv, x[off : off + n], r)))
            off += n
        return recvs

    def _receive(self, layer: int, i: int, x: torch.Tensor, recvs: list):
        """Waits for the posted receives of the micro-batch's rows into `x`; its rows and the prefetch's gap, a
        failed peer's rows zeroed."""
        gap = None
        if self.prefetch is not None and i == 0 and layer in self.ffn.cfg.moe_layers:  # once per layer
            gap = self.prefetch.in_gap(layer, lambda: all(w is not FAILED and w.is_completed() for *_, w in recvs))
        ok = [(o, n) for r, o, n, w in recvs if self._wait(w, r, f"layer {layer} MoE input receive")]
        if len(ok) < len(recvs):
            x = self._without_failed(i, x, ok)
        return x, gap

    def _without_failed(self, i: int, x: torch.Tensor, ok: list[tuple[int, int]]) -> torch.Tensor:
        """The micro-batch's input with a failed peer's rows zeroed (computed and thrown away, never read
        uninitialised), in new memory: the failed receive may still sit on its stream after the abort and
        write into the pool's buffer, so that buffer is retired rather than written or used again."""
        clean = torch.zeros(x.shape, dtype=x.dtype, device=x.device)  # not zeros_like: the fake NPU counts x as read
        for o, n in ok:
            clean[o : o + n].copy_(x[o : o + n])
        self._retire((self.pool if self.packed is None else self.packed).retire(i))
        return clean
