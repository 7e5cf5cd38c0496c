"""The FFN node's serving loop: receive -> route -> experts -> send, for every attention peer.

It never initiates: each step starts with a header from every active attention node, after which the
sizes of all messages are known (afd.dataplane.protocol). Per layer and micro-batch, the MoE inputs of all peers
are received into one preallocated buffer, so the experts see the aggregate batch of every peer.

Pairs come and go one at a time (afd.dataplane.pairs): a pair formed by the node's Pairs service
(ffn_node/pairs.py) is adopted at the next step boundary, in place of that attention rank's old one.
A peer that fails (its process died, it timed out, it broke the protocol, it formed a new pair) is
dropped, its pair aborted, and the others are served on. A dead peer is noticed by an error on its pair
(on gloo at once: its sockets close), by its replacement's new pair, by the control plane (on NCCL/HCCL,
where its transfers just never complete: the heartbeat thread aborts its pair after heartbeat_timeout,
afd.node.runtime) or by a timeout (comm_timeout); this loop waits for it meanwhile, and the others wait
with it. `serve` returns when every peer left for good, one asked for shutdown, or peers failed and
none formed a pair again within `cluster.rejoin_timeout`.

The loop's time, compute and idle, is accounted by ffn_node/loop_time.py.
"""

from __future__ import annotations

import enum
import logging
import queue
import time
from collections import deque

import torch
from torch import nn

from afd.backend import Backend, host_syncs
from afd.dataplane.buffers import BufferPool
from afd.dataplane.prefetch import PrefetchSchedule
from afd.dataplane.protocol import (
    FLAG_IDLE,
    FLAG_LEAVE,
    FLAG_MTP,
    FLAG_SHUTDOWN,
    HEADER_LEN,
    IDLE_ACK_LEN,
    ProtocolError,
    StepHeader,
    dequantize,
)
from afd.dataplane.transport import DataPlane, PeerError
from afd.observability.ffn_metrics import FFNMetrics
from afd.observability.timing import Timers
from ffn_node.loop_time import LoopTime
from ffn_node.receives import FAILED, Receives
from ffn_node.routed import RoutedRows

log = logging.getLogger("afd.ffn")
_GONE = FLAG_LEAVE
RETIRED_KEPT = 64
"""Buffers a failed peer's aborted transfer may still touch, kept from reuse (the oldest go first)."""


class ServeEnd(enum.Enum):
    SHUTDOWN = "shutdown requested"
    LEFT = "every attention peer left"
    ABANDONED = "attention peers failed and none formed a pair again within cluster.rejoin_timeout"


class FFNServer(Receives, RoutedRows):
    def __init__(
        self,
        ffn: nn.Module,
        backend: Backend,
        plane: DataPlane,
        formed: queue.SimpleQueue,
        dtype: torch.dtype,
        timers: Timers | None = None,
        prefetch: PrefetchSchedule | None = None,
        metrics: FFNMetrics | None = None,
        rejoin_timeout: float = 60.0,
        current=lambda group: True,
        attention_ranks: int = 1,
        exchange_dtype: str = "same",
        routing: str = "ffn",
        join_timeout: float = 0.0,
    ):
        """formed: the pairs formed (ffn_node/pairs.py), to adopt: lists of (attention rank, name,
        PairLink), every TP rank of one attention node, taken into use at one step boundary; current(group)
        says whether they are still their ranks' latest (ffn_node/pairs.py: a rank may have asked again).
        exchange_dtype: layout.exchange_dtype, how the MoE inputs arrive (afd.dataplane.protocol).
        routing: layout.routing, resolved: ffn (every token arrives, this node routes it) or attention (the
        rows for this node's experts arrive with their ids and weights, after a count). join_timeout: how long
        the first step waits for every attention rank's pair (cluster.startup_timeout)."""
        self.ffn, self.backend = ffn, backend
        self.hidden = ffn.cfg.hidden_size
        self.timers = timers or Timers()
        self.pool = BufferPool(backend.device, dtype)
        self.exchange_dtype = exchange_dtype
        self.routing = routing
        self.packed = None if exchange_dtype == "same" and routing == "ffn" else BufferPool(backend.device, torch.uint8)
        """Receive buffers of quantized MoE inputs (uint8 rows: bits, then the scale), dequantized into `pool`'s."""
        self.plane, self.formed, self.rejoin_timeout, self.current = plane, formed, rejoin_timeout, current
        self.attention_ranks = attention_ranks
        """Every attention rank of the cluster: the loop ends as LEFT only once each has left, not when the
        ones that joined so far did (another may still be forming its pairs)."""
        self.active: list[int] = []
        self.names: dict[int, str] = {}
        self.gone: dict[int, str] = {}
        """Peers that failed and have not formed a pair again, and why."""
        self.left: set[int] = set()
        """Peers that left for good (their engine stopped)."""
        self._headers: dict[int, torch.Tensor] = {}
        self._next_step: dict[int, int] = {}
        """The step id each attention peer's next header must carry (idle and leave headers repeat it)."""
        self._retired: deque[torch.Tensor] = deque(maxlen=RETIRED_KEPT)
        self.prefetch = prefetch
        """Hints weights while waiting for each layer's inputs, sized by the waits this loop measures."""
        self.metrics = metrics
        self._ack = torch.empty(IDLE_ACK_LEN, dtype=torch.int64, device=backend.device)
        self._counts: dict[int, torch.Tensor] = {}
        """Per attention peer, the receive buffer of its row count (routing attention)."""
        self.steps = 0
        self.tokens = 0
        self.time = LoopTime(backend, self.timers, metrics, prefetch)
        self._joined = False
        self._join_by = time.monotonic() + join_timeout
        """Before its first step the loop waits, until then, for every attention rank's pair: each FFN node
        then groups every attention rank's k-th header into its k-th step. An attention rank taken in later
        at a different header on two FFN nodes could have its steps grouped with another's differently on
        each, and two such work steps wait on each other (docs/architecture/dataplane.md, "A:F ratios")."""

    def serve(self) -> ServeEnd:
        """Runs until every attention peer left, one asks for shutdown, or failed peers stay away."""
        self.backend.bind_thread()
        self.time.restart()
        try:
            return self._serve()
        finally:
            self.time.idle()

    def _serve(self) -> ServeEnd:
        while True:
            end = self._adopt()
            if end is not None:
                return end
            if not self.active:
                continue
            headers = self._recv_headers()
            if any(h.flags & FLAG_SHUTDOWN for h in headers.values()):
                return ServeEnd.SHUTDOWN
            for r, h in headers.items():
                if h.flags & FLAG_LEAVE:
                    log.info("attention rank %d (%s) left", r, self.names[r])
                    self.active.remove(r)
                    self.left.add(r)
                    self.plane.drop(r)
            work = {r: h for r, h in headers.items() if not h.flags & (_GONE | FLAG_IDLE)}
            if work:
                self._run_step(work)
            idle = [r for r, h in headers.items() if h.flags & FLAG_IDLE and not h.flags & _GONE]
            if idle:
                self._ack.fill_(len(work))
                acks = [(r, self._post(self.plane.isend, self._ack, r)) for r in idle]
                if not all([self._wait(w, r, "idle ack send") for r, w in acks]):
                    self._retire(self._ack)
                    self._ack = torch.empty_like(self._ack)

    # ---- pairs come and go -----------------------------------------------------------------------

    def _adopt(self) -> ServeEnd | None:
        """At a step boundary: takes every pair formed since into use. With no peer active, waits for one;
        says when to stop instead (every peer left for good, or failed ones stayed away too long)."""
        waiting_since = time.monotonic()
        while True:
            if not self._joined and (len(self.active) >= self.attention_ranks or time.monotonic() > self._join_by):
                self._joined = True
            first = not self._joined
            try:
                ranks = self.formed.get(timeout=0.2) if not self.active or first else self.formed.get_nowait()
            except queue.Empty:
                if self.active and not first:
                    return None
                if self.active:
                    continue
                if len(self.left) >= self.attention_ranks and not self.gone:
                    return ServeEnd.LEFT
                if self.gone and time.monotonic() - waiting_since > self.rejoin_timeout:
                    return ServeEnd.ABANDONED
                continue
            if self.current(ranks):
                for r, name, link in ranks:
                    self._take(r, name, link)
            if self.formed.empty() and (self._joined or len(self.active) >= self.attention_ranks):
                self._joined = True
                return None

    def _take(self, r: int, name: str, link) -> None:
        again = r in self.gone or r in self.active
        if r in self.active:
            self.active.remove(r)
        self.plane.add(r, link)  # the old pair, if any, goes (aborted where its work may be queued)
        self.gone.pop(r, None)
        self.left.discard(r)
        self.active.append(r)
        self.names[r] = name
        self._next_step[r] = 0
        if r in self._counts:  # like the header's: the old pair's receive may still write into it
            self._retire(self._counts.pop(r))
        if r in self._headers:  # the old pair's receive into it may have been aborted, not finished
            self._retire(self._headers[r])
        self._headers[r] = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.backend.device)
        log.info(
            "attention rank %d (%s) %s; serving %d peer(s)",
            r,
            name,
            "formed its pair again" if again else "joined",
            len(self.active),
        )

    # ---- one failing peer never takes the others down --------------------------------------------

    def _drop(self, r: int, why: str, level: int = logging.WARNING, abort: bool = False) -> None:
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

    def _fail(self, r: int, e: PeerError) -> None:
        self._drop(r, str(e))  # the data plane aborted the pair; the other peers' pairs are untouched

    def _post(self, op, tensor: torch.Tensor, r: int):
        """isend/irecv to a live peer; FAILED (and the peer dropped) when it is gone."""
        if r not in self.active:
            return FAILED
        try:
            return op(tensor, r)
        except PeerError as e:
            self._fail(r, e)
            return FAILED

    def _wait(self, work, r: int, what: str) -> bool:
        if work is FAILED or r not in self.active:
            return False
        try:
            self.plane.wait(work, r, what)
            return True
        except PeerError as e:
            self._fail(r, e)
            return False

    # ---- the protocol ------------------------------------------------------------------------------

    def _recv_headers(self) -> dict[int, StepHeader]:
        works = [(r, self._post(self.plane.irecv, self._headers[r], r)) for r in list(self.active)]
        received = [r for r, w in works if self._wait(w, r, "step header receive")]
        try:  # the headers are read on the host next: a deadline the watchdog saw pass makes them garbage
            self.plane.check()
        except PeerError as e:
            if e.peer is not None:
                self._fail(e.peer, e)
            received = [r for r in received if r in self.active]
        self.time.idle()  # between steps: the last step's sends and acks, then the wait for these headers
        headers = {}
        # every peer's header in one read: on a device each read is a host sync, and this is the step's only one
        rows = host_syncs.to_list(torch.stack([self._headers[r] for r in received])) if received else []
        for r, v in zip(received, rows):
            try:
                h = StepHeader.from_values(v, r)
            except ProtocolError as e:
                self._drop(r, f"data plane: {e}", abort=True)
                continue
            if h.flags & FLAG_MTP and not self.ffn.mtp_layers:
                self._drop(
                    r,
                    f"data plane: rank {r} sent an MTP step, but this FFN node holds no MTP layer: "
                    "start every node with the same engine.speculative_tokens",
                    abort=True,
                )
                continue
            if h.step_id != self._next_step[r]:  # a desynchronised peer is an error here, never wrong numbers
                self._drop(
                    r,
                    f"data plane: rank {r} sent step {h.step_id} where step {self._next_step[r]} was "
                    "due: the protocol is out of step",
                    abort=True,
                )
                continue
            if not h.flags & (FLAG_IDLE | _GONE):
                self._next_step[r] += 1
            headers[r] = h
        return headers

    def _layers(self, h: StepHeader) -> tuple[int, ...]:
        """The MoE layers a peer's step runs: the decoder's, or the MTP module's (FLAG_MTP)."""
        return self.ffn.mtp_layers if h.flags & FLAG_MTP else self.ffn.cfg.moe_layers

    def _run_step(self, headers: dict[int, StepHeader]) -> None:
        num_mb = max(len(h.tokens) for h in headers.values())
        counts = {r: list(h.tokens) + [0] * (num_mb - len(h.tokens)) for r, h in headers.items()}
        runs = {r: self._layers(h) for r, h in headers.items()}
        sends, outputs = [], []  # outputs stay referenced until their sends complete

        def parts_of(layer: int, i: int) -> list[tuple[int, int]]:
            return [(r, counts[r][i]) for r in headers if layer in runs[r] and counts[r][i] > 0 and r in self.active]

        # each peer's layers stay in its own order
        todo = [(layer, i) for layer in sorted(set().union(*runs.values())) for i in range(num_mb)]
        ahead: tuple | None = None  # (layer, i, parts, its posted receives)
        for k, (layer, i) in enumerate(todo):
            parts, posted = parts_of(layer, i), None
            if ahead is not None and ahead[:2] == (layer, i):
                parts, posted = ahead[2], ahead[3]
            if not parts:
                continue
            if posted is None and self.routing != "attention":
                posted = self._post_inputs(i, parts)  # before the next one's: a pair matches receives in order
            ahead = self._post_ahead(todo[k + 1 :], i, parts_of)
            y, works = self._run_micro_batch(layer, i, parts, posted)
            if y is not None:
                outputs.append(y)
            sends += works
        if not all([self._wait(w, r, "MoE output send") for r, w in sends]):
            for y in outputs:
                self._retire(y)
        self.steps += 1
        self.time.account()

    def _retire(self, t: torch.Tensor) -> None:
        """A tensor a failed peer's send may still read (an aborted transfer may stay on its stream): kept
        from reuse, so that its memory is not written again while it might be read (or, a receive buffer,
        written by a failed peer's receive while it is read for another); the last RETIRED_KEPT of them."""
        self._retired.append(t)

    def _run_micro_batch(self, layer: int, i: int, parts: list[tuple[int, int]], posted=None):
        """posted: _post_inputs(i, parts), where _post_ahead posted it."""
        if self.routing == "attention":
            return self._run_routed(layer, i, parts)
        total = sum(n for _, n in parts)
        x, gap = self._receive(layer, i, *(posted or self._post_inputs(i, parts)))
        if self.packed is not None:  # rows of a failed peer come out zeroed (_without_failed zeroed their bytes)
            x = dequantize(x, self.exchange_dtype, self.pool.get(i, total, self.hidden))
        self.time.idle(layer)  # since the last compute: the previous sends, the hint, the wait for inputs
        with torch.inference_mode():
            y = self.time.compute(layer, gap, lambda: self.ffn(self.backend, layer, x))
        return self._after_compute(layer, total, parts, y)

    def _after_compute(self, layer: int, total: int, parts: list[tuple[int, int]], y: torch.Tensor):
        if self.prefetch is not None:
            self.prefetch.after_compute(layer)
            if self.metrics is not None:
                self.metrics.prefetch_bytes.inc(self.prefetch.take_bytes())
                self.metrics.prefetch_budget[layer] = self.prefetch.last_budget.get(layer, 0)
        self.tokens += total
        if self.metrics is not None:
            self.metrics.tokens.inc(total)
            self.metrics.add_routed(self.ffn.layer(layer).experts)
        sends, off = [], 0
        for r, n in parts:
            sends.append((r, self._post(self.plane.isend, y[off : off + n], r)))
            off += n
        return y, sends
