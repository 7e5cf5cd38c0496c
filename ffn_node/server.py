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

import torch

from afd.backend import Backend, host_syncs
from afd.dataplane.prefetch import PrefetchSchedule
from afd.dataplane.protocol import (
    FLAG_IDLE,
    FLAG_LEAVE,
    FLAG_MTP,
    FLAG_SHUTDOWN,
    IDLE_ACK_LEN,
    ProtocolError,
    StepHeader,
    dequantize,
)
from afd.dataplane.transport import DataPlane, PeerError
from afd.model.halves import FFNHalf
from afd.observability.ffn_metrics import FFNMetrics
from afd.observability.timing import Timers
from ffn_node.loop_time import LoopTime
from ffn_node.peers import FormedPair, PeerRows, Peers, Transfer
from ffn_node.receives import Receives
from ffn_node.routed import RoutedRows

log = logging.getLogger("afd.ffn")
_GONE = FLAG_LEAVE


class ServeEnd(enum.Enum):
    SHUTDOWN = "shutdown requested"
    LEFT = "every attention peer left"
    ABANDONED = "attention peers failed and none formed a pair again within cluster.rejoin_timeout"


class FFNServer:
    def __init__(
        self,
        ffn: FFNHalf,
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
        """formed: the pairs formed (ffn_node/pairs.py), to adopt: lists of FormedPair, every TP rank of one
        attention node, taken into use at one step boundary; current(group) says whether they are still their
        ranks' latest (ffn_node/pairs.py: a rank may have asked again).
        exchange_dtype: layout.exchange_dtype, how the MoE inputs arrive (afd.dataplane.protocol).
        routing: layout.routing, resolved: ffn (every token arrives, this node routes it) or attention (the
        rows for this node's experts arrive with their ids and weights, after a count). join_timeout: how long
        the first step waits for every attention rank's pair (cluster.startup_timeout)."""
        self.ffn, self.backend = ffn, backend
        self.hidden = ffn.cfg.hidden_size
        self.timers = timers or Timers()
        self.exchange_dtype = exchange_dtype
        self.routing = routing
        self.plane, self.formed, self.rejoin_timeout, self.current = plane, formed, rejoin_timeout, current
        self.attention_ranks = attention_ranks
        """Every attention rank of the cluster: the loop ends as LEFT only once each has left, not when the
        ones that joined so far did (another may still be forming its pairs)."""
        self.peers = Peers(plane, backend.device)
        self.receives = Receives(self.peers, backend, self.hidden, dtype, exchange_dtype, routing, prefetch, ffn.cfg)
        self.routed = (
            RoutedRows(self.peers, self.receives, ffn.cfg.experts_per_token) if routing == "attention" else None
        )
        self.prefetch = prefetch
        """Hints weights while waiting for each layer's inputs, sized by the waits this loop measures."""
        self.metrics = metrics
        self._ack = torch.empty(IDLE_ACK_LEN, dtype=torch.int64, device=backend.device)
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
        peers = self.peers
        while True:
            end = self._adopt()
            if end is not None:
                return end
            if not peers.active:
                continue
            headers = self._recv_headers()
            if any(h.flags & FLAG_SHUTDOWN for h in headers.values()):
                return ServeEnd.SHUTDOWN
            for r, h in headers.items():
                if h.flags & FLAG_LEAVE:
                    peers.leave(r)
            work = {r: h for r, h in headers.items() if not h.flags & (_GONE | FLAG_IDLE)}
            if work:
                self._run_step(work)
            idle = [r for r, h in headers.items() if h.flags & FLAG_IDLE and not h.flags & _GONE]
            if idle:
                self._ack.fill_(len(work))
                acks = [(r, peers.post(self.plane.isend, self._ack, r)) for r in idle]
                if not all([peers.wait(w, r, "idle ack send") for r, w in acks]):
                    peers.retire(self._ack)
                    self._ack = torch.empty_like(self._ack)

    def _adopt(self) -> ServeEnd | None:
        """At a step boundary: takes every pair formed since into use. With no peer active, waits for one;
        says when to stop instead (every peer left for good, or failed ones stayed away too long)."""
        peers = self.peers
        waiting_since = time.monotonic()
        while True:
            if not self._joined and (len(peers.active) >= self.attention_ranks or time.monotonic() > self._join_by):
                self._joined = True
            first = not self._joined
            try:
                group = self.formed.get(timeout=0.2) if not peers.active or first else self.formed.get_nowait()
            except queue.Empty:
                if peers.active and not first:
                    return None
                if peers.active:
                    continue
                if len(peers.left) >= self.attention_ranks and not peers.gone:
                    return ServeEnd.LEFT
                if peers.gone and time.monotonic() - waiting_since > self.rejoin_timeout:
                    return ServeEnd.ABANDONED
                continue
            if self.current(group):
                pair: FormedPair
                for pair in group:
                    peers.take(pair)
            if self.formed.empty() and (self._joined or len(peers.active) >= self.attention_ranks):
                self._joined = True
                return None

    # ---- the protocol ------------------------------------------------------------------------------

    def _recv_headers(self) -> dict[int, StepHeader]:
        peers = self.peers
        works = [(r, peers.post(self.plane.irecv, peers.headers[r], r)) for r in list(peers.active)]
        received = [r for r, w in works if peers.wait(w, r, "step header receive")]
        try:  # the headers are read on the host next: a deadline the watchdog saw pass makes them garbage
            self.plane.check()
        except PeerError as e:
            if e.peer is not None:
                peers.fail(e.peer, e)
            received = [r for r in received if r in peers.active]
        self.time.idle()  # between steps: the last step's sends and acks, then the wait for these headers
        headers = {}
        # every peer's header in one read: on a device each read is a host sync, and this is the step's only one
        rows = host_syncs.to_list(torch.stack([peers.headers[r] for r in received])) if received else []
        for r, v in zip(received, rows):
            try:
                h = StepHeader.from_values(v, r)
            except ProtocolError as e:
                peers.drop(r, f"data plane: {e}", abort=True)
                continue
            if h.flags & FLAG_MTP and not self.ffn.mtp_layers:
                peers.drop(
                    r,
                    f"data plane: rank {r} sent an MTP step, but this FFN node holds no MTP layer: "
                    "start every node with the same engine.speculative_tokens",
                    abort=True,
                )
                continue
            if h.step_id != peers.next_step[r]:  # a desynchronised peer is an error here, never wrong numbers
                peers.drop(
                    r,
                    f"data plane: rank {r} sent step {h.step_id} where step {peers.next_step[r]} was "
                    "due: the protocol is out of step",
                    abort=True,
                )
                continue
            if not h.flags & (FLAG_IDLE | _GONE):
                peers.next_step[r] += 1
            headers[r] = h
        return headers

    def _layers(self, h: StepHeader) -> tuple[int, ...]:
        """The MoE layers a peer's step runs: the decoder's, or the MTP module's (FLAG_MTP)."""
        return self.ffn.mtp_layers if h.flags & FLAG_MTP else self.ffn.cfg.moe_layers

    def _run_step(self, headers: dict[int, StepHeader]) -> None:
        num_mb = max(len(h.tokens) for h in headers.values())
        counts = {r: list(h.tokens) + [0] * (num_mb - len(h.tokens)) for r, h in headers.items()}
        runs = {r: self._layers(h) for r, h in headers.items()}
        sends: list[Transfer] = []
        outputs = []  # they stay referenced until their sends complete
        active = self.peers.active

        def parts_of(layer: int, i: int) -> list[PeerRows]:
            return [PeerRows(r, counts[r][i]) for r in headers if layer in runs[r] and counts[r][i] > 0 and r in active]

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
                posted = self.receives.post(i, parts)  # before the next one's: a pair matches receives in order
            ahead = self.receives.post_ahead(todo[k + 1 :], i, parts_of)
            y, works = self._run_micro_batch(layer, i, parts, posted)
            if y is not None:
                outputs.append(y)
            sends += works
        if len(self.peers.wait_all(sends, "MoE output send")) < len(sends):
            for y in outputs:
                self.peers.retire(y)
        self.steps += 1
        self.time.account()

    def _run_micro_batch(self, layer: int, i: int, parts: list[PeerRows], posted=None):
        """posted: Receives.post(i, parts), where Receives.post_ahead posted it. Returns (y, its sends); (None,
        []) when no row came (routing attention)."""
        if self.routed is not None:
            got = self.routed.receive(layer, i, parts)
            if got is None:
                return None, []
            self.time.idle(layer)
            with torch.inference_mode():
                y = self.time.compute(
                    layer, got.gap, lambda: self.ffn.routed(self.backend, layer, got.x, got.weights, got.ids)
                )
            return self._after_compute(layer, got.rows, y)
        rx = self.receives
        total = sum(p.rows for p in parts)
        x, gap = rx.receive(layer, i, *(posted or rx.post(i, parts)))
        if rx.packed is not None:  # rows of a failed peer come out zeroed (their bytes were zeroed)
            x = dequantize(x, self.exchange_dtype, rx.pool.get(i, total, self.hidden))
        self.time.idle(layer)  # since the last compute: the previous sends, the hint, the wait for inputs
        with torch.inference_mode():
            y = self.time.compute(layer, gap, lambda: self.ffn(self.backend, layer, x))
        return self._after_compute(layer, parts, y)

    def _after_compute(self, layer: int, parts: list[PeerRows], y: torch.Tensor) -> tuple[torch.Tensor, list[Transfer]]:
        """Accounts the micro-batch's rows, and sends each peer its rows of `y`."""
        total = sum(p.rows for p in parts)
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
        for p in parts:
            sends.append(
                Transfer(p.peer, off, p.rows, self.peers.post(self.plane.isend, y[off : off + p.rows], p.peer))
            )
            off += p.rows
        return y, sends
