"""The FFN node's serving loop: receive -> route -> experts -> send, for every attention peer.

It never initiates: each step starts with a header from every active attention node, after which the
sizes of all messages are known (afd.dataplane.protocol). Per layer and micro-batch, the MoE inputs of all peers
are received into one preallocated buffer, so the experts see the aggregate batch of every peer.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from afd.backend import Backend
from afd.dataplane.protocol import (
    FLAG_IDLE,
    FLAG_LEAVE,
    FLAG_SHUTDOWN,
    HEADER_LEN,
    IDLE_ACK_LEN,
    ProtocolError,
    StepHeader,
)
from afd.dataplane.transport import BufferPool, DataPlane, PeerError
from afd.observability.metrics import FFNMetrics
from afd.observability.timing import Timers

log = logging.getLogger("afd.ffn")


class FFNServer:
    def __init__(self, ffn: nn.Module, backend: Backend, plane: DataPlane, attention_ranks: list[int],
                 dtype: torch.dtype, timers: Timers | None = None, layer_hook=None,
                 metrics: FFNMetrics | None = None):
        self.ffn, self.backend, self.plane = ffn, backend, plane
        self.active = list(attention_ranks)
        self.hidden = ffn.cfg.hidden_size
        self.timers = timers or Timers()
        self.pool = BufferPool(backend.device, dtype)
        self._headers = {r: torch.empty(HEADER_LEN, dtype=torch.int64) for r in attention_ranks}
        self.layer_hook = layer_hook
        """Called as hook(layer) -> bytes while waiting for that layer's inputs (afd.dataplane.prefetch)."""
        self.metrics = metrics
        self._ack = torch.empty(IDLE_ACK_LEN, dtype=torch.int64)
        self._next_step = dict.fromkeys(attention_ranks, 0)
        """The step id each attention peer's next header must carry (idle and leave headers repeat it)."""
        self.steps = 0
        self.tokens = 0

    def reset(self, plane: DataPlane, attention_ranks: list[int]) -> None:
        """Serve a new data-plane generation (after a node was replaced)."""
        self.plane, self.active = plane, list(attention_ranks)
        self._next_step = dict.fromkeys(attention_ranks, 0)

    def serve(self) -> str:
        """Runs until every attention peer has left or one asks for shutdown; returns why it stopped."""
        while self.active:
            headers = self._recv_headers()
            if any(h.flags & FLAG_SHUTDOWN for h in headers.values()):
                return "shutdown requested"
            for r, h in headers.items():
                if h.flags & FLAG_LEAVE:
                    log.info("attention rank %d left", r)
                    self.active.remove(r)
            work = {r: h for r, h in headers.items() if not h.flags & (FLAG_LEAVE | FLAG_IDLE)}
            if work:
                self._run_step(work)
            idle = [r for r, h in headers.items() if h.flags & FLAG_IDLE and not h.flags & FLAG_LEAVE]
            if idle:
                self._ack.fill_(len(work))
                acks = [(r, self.plane.isend(self._ack, r)) for r in idle]
                for r, w in acks:
                    self.plane.wait(w, r, "idle ack send")
        return "all attention peers left"

    def _recv_headers(self) -> dict[int, StepHeader]:
        t0 = time.perf_counter()
        works = [(r, self.plane.irecv(self._headers[r], r)) for r in self.active]
        for r, w in works:
            self.plane.wait(w, r, "step header receive")
        self.timers.add("idle", time.perf_counter() - t0)
        try:
            headers = {r: StepHeader.decode(self._headers[r], r) for r in self.active}
        except ProtocolError as e:
            raise PeerError(f"data plane: {e}", None) from None
        for r, h in headers.items():  # a desynchronised peer is an error here, never wrong numbers later
            if h.step_id != self._next_step[r]:
                raise PeerError(f"data plane: rank {r} sent step {h.step_id} where step {self._next_step[r]} was "
                                "due: the protocol is out of step", r)
            if not h.flags & (FLAG_IDLE | FLAG_LEAVE):
                self._next_step[r] += 1
        return headers

    def _run_step(self, headers: dict[int, StepHeader]) -> None:
        num_mb = max(len(h.tokens) for h in headers.values())
        counts = {r: list(h.tokens) + [0] * (num_mb - len(h.tokens)) for r, h in headers.items()}
        sends, outputs = [], []  # outputs stay referenced until their sends complete
        for layer in range(self.ffn.cfg.num_layers):
            for i in range(num_mb):
                parts = [(r, counts[r][i]) for r in headers if counts[r][i] > 0]
                if parts:
                    y, works = self._run_micro_batch(layer, i, parts)
                    outputs.append(y)
                    sends += works
        for r, w in sends:
            self.plane.wait(w, r, "MoE output send")
        self.steps += 1

    def _run_micro_batch(self, layer: int, i: int, parts: list[tuple[int, int]]):
        total = sum(n for _, n in parts)
        x = self.pool.get(i, total, self.hidden)  # [T_all, H]: every peer's tokens, peer by peer
        recvs, off = [], 0
        for r, n in parts:
            recvs.append((r, self.plane.irecv(x[off:off + n], r)))
            off += n
        if self.layer_hook is not None and i == 0:  # once per layer, while its first inputs travel
            hinted = self.layer_hook(layer) or 0
            if self.metrics is not None:
                self.metrics.prefetch_bytes.inc(hinted)
        t0 = time.perf_counter()
        for r, w in recvs:
            self.plane.wait(w, r, f"layer {layer} MoE input receive")
        t1 = time.perf_counter()
        with torch.inference_mode():
            y = self.ffn(self.backend, layer, x)
        self.backend.synchronize()
        t2 = time.perf_counter()
        self.timers.add("idle", t1 - t0)
        self.timers.add("compute", t2 - t1)
        self.tokens += total
        if self.metrics is not None:
            m = self.metrics
            m.idle.observe(t1 - t0)
            m.compute.observe(t2 - t1)
            m.tokens.inc(total)
            m.add_expert_tokens(self.ffn.layers[layer].experts.last_counts)
        sends, off = [], 0
        for r, n in parts:
            sends.append((r, self.plane.isend(y[off:off + n], r)))
            off += n
        return y, sends
