"""How the attention side reaches the MoE half: in-process, or over the data plane.

The runner sees one interface: `begin_step` with the token count of each micro-batch, then per layer
and micro-batch `submit(m)` returning a handle whose `wait()` gives the MoE output, then `end_step`, which
says what the step's exchange did (ExchangeStats). Calls come in (layer, micro-batch) order, which is also
the order of messages on the wire. A step with `mtp=True`
runs only the multi-token-prediction module's MoE layer (afd.dataplane.protocol, FLAG_MTP).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Protocol

import torch
from torch import nn

from afd.backend import Backend, host_syncs
from afd.backend.base import copy_to_device
from afd.dataplane.buffers import BufferPool
from afd.dataplane.protocol import (
    DIRECTIONS,
    FLAG_IDLE,
    FLAG_LEAVE,
    FLAG_MTP,
    FLAG_SHUTDOWN,
    HEADER_LEN,
    IDLE_ACK_LEN,
    StepHeader,
    quantize,
)
from afd.dataplane.transport import DataPlane
from afd.observability.timing import Timers


class MoEHandle(Protocol):
    def wait(self) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class ExchangeStats:
    """What an exchange did: over one step (MoEExchange.end_step), or since it was made (`totals`)."""

    ffn_wait: float = 0.0
    """Seconds blocked waiting for MoE outputs: the exchange that was not hidden."""
    to_ffn: int = 0
    """Bytes of MoE inputs sent to the FFN nodes (afd_a2f_bytes; afd_exchange_bytes{direction="to_ffn"})."""
    to_attention: int = 0
    """Bytes of MoE outputs received from them."""
    zero_slots: int = 0
    """Token assignments to identity experts applied on this side (routing attention)."""

    def __sub__(self, other: ExchangeStats) -> ExchangeStats:
        return ExchangeStats(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def bytes(self) -> dict[str, int]:
        """Bytes by direction (afd.dataplane.protocol.DIRECTIONS)."""
        return {"to_ffn": self.to_ffn, "to_attention": self.to_attention}


class MoEExchange(Protocol):
    timers: Timers
    """`ffn_wait`: seconds blocked waiting for MoE outputs (the exchange that was not hidden)."""

    def begin_step(self, tokens_per_micro_batch: list[int], mtp: bool = False) -> None:
        """mtp: the step runs only the MTP module's MoE layer (its submits name that layer)."""
        ...

    def submit(self, layer: int, micro_batch: int, m: torch.Tensor, **kw) -> MoEHandle:
        """kw: `token_ids` [T] when the layer's router reads them (AttentionHalf.moe_reads_token_ids)."""
        ...

    def end_step(self) -> ExchangeStats:
        """The step is done on this side: what its exchange did since begin_step."""
        ...

    def check(self) -> None:
        """Raises the PeerError of a transfer whose deadline passed without the host waiting for it: called
        after the step's results were read on the host."""
        ...

    def idle(self) -> int:
        """A step with no tokens (keeps FFN peers' steps going); returns how many attention nodes had work."""
        ...

    def leave(self, shutdown: bool = False) -> None:
        """No more steps from this attention node."""
        ...


class Ready:
    """A handle whose result is already there."""

    def __init__(self, y: torch.Tensor):
        self._y = y

    def wait(self) -> torch.Tensor:
        return self._y


class LocalMoE:
    """The colocated reference: the FFN half runs in this process, synchronously."""

    def __init__(self, ffn: nn.Module, backend: Backend):
        self.ffn, self.backend = ffn, backend
        self.timers = Timers()

    def begin_step(self, tokens_per_micro_batch: list[int], mtp: bool = False) -> None:
        pass

    def submit(self, layer: int, micro_batch: int, m: torch.Tensor, **kw) -> MoEHandle:
        return Ready(self.ffn(self.backend, layer, m, **kw))

    def end_step(self) -> ExchangeStats:
        return ExchangeStats()

    def check(self) -> None:
        pass

    def idle(self) -> int:
        return 0

    def leave(self, shutdown: bool = False) -> None:
        pass


class _RemoteHandle:
    def __init__(self, owner: RemoteMoE, works: list, recv_bufs: list[torch.Tensor], keep: torch.Tensor | None):
        self.owner, self.works, self.recv_bufs, self.keep = owner, works, recv_bufs, keep

    def wait(self) -> torch.Tensor:
        self.owner.wait_all(self.works)
        self.keep = None
        if len(self.recv_bufs) == 1:
            return self.recv_bufs[0]
        y = self.recv_bufs[0].clone()  # partial sums of the FFN nodes' experts, added in rank order
        for b in self.recv_bufs[1:]:
            y += b
        return y


class RemoteMoE:
    """The MoE half on FFN nodes, over the data plane (the message order of afd.dataplane.protocol)."""

    def __init__(
        self,
        plane: DataPlane,
        ffn_ranks: list[int],
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
        timers: Timers | None = None,
        exchange_dtype: str = "same",
    ):
        """exchange_dtype: layout.exchange_dtype, how the MoE inputs cross (afd.dataplane.protocol)."""
        self.plane, self.ffn_ranks, self.hidden = plane, ffn_ranks, hidden
        self.exchange_dtype = exchange_dtype
        self.timers = timers or Timers()
        self.pool = BufferPool(device, dtype)
        self._header_sends: list = []
        self._headers: dict[int, torch.Tensor] = {}
        self._acks: dict[int, torch.Tensor] = {}
        self.step_ids: dict[int, int] = {}
        """The next step id of each FFN peer: a pair counts from 0 from its formation, so a pair adopted later
        (afd.dataplane.dispatch: a replacement FFN node) counts on its own."""
        for f in ffn_ranks:
            self._add_peer(f)
        self.exchange_bytes = dict.fromkeys(DIRECTIONS, 0)
        """Bytes of MoE inputs sent and results received, over every FFN peer, since the exchange was made."""
        self.zero_slots = 0
        """Token assignments to identity experts applied on this side (a routed exchange's)."""
        self._begun = ExchangeStats()
        """`totals()` when the step began."""

    def _add_peer(self, f: int) -> None:
        """A newly formed pair with FFN node f: its header and ack buffers, and its steps counted from 0."""
        device = self.pool.device
        self._headers[f] = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
        self._acks[f] = torch.empty(IDLE_ACK_LEN, dtype=torch.int64, device=device)
        self.step_ids[f] = 0

    def _send_header(self, tokens: tuple[int, ...], flags: int) -> None:
        self._header_sends = []
        for f in self.ffn_ranks:  # the last headers' sends were waited for in end_step
            copy_to_device(self._headers[f], StepHeader(self.step_ids[f], tokens, flags).encode())
            self._header_sends.append((f, self.plane.isend(self._headers[f], f), "step header send"))

    def wait_all(self, works: list) -> None:
        """Waits for a handle's transfers ((peer, work, what) each), the time counted as ffn_wait."""
        t0 = time.perf_counter()
        for peer, work, what in works:
            self.plane.wait(work, peer, what)
        self.timers.add("ffn_wait", time.perf_counter() - t0)

    def totals(self) -> ExchangeStats:
        """What this exchange did since it was made."""
        sent, back = self.exchange_bytes["to_ffn"], self.exchange_bytes["to_attention"]
        return ExchangeStats(self.timers.total("ffn_wait"), sent, back, self.zero_slots)

    def begin_step(self, tokens_per_micro_batch: list[int], mtp: bool = False) -> None:
        self._begun = self.totals()
        self._send_header(tuple(tokens_per_micro_batch), FLAG_MTP if mtp else 0)
        for f in self.ffn_ranks:
            self.step_ids[f] += 1

    def submit(self, layer: int, micro_batch: int, m: torch.Tensor, **kw) -> MoEHandle:
        if kw:  # the broadcast carries m alone: a router that reads token ids runs on the attention side
            raise ValueError(
                f"layer {layer}'s router reads token ids, which layout.routing ffn does not send: "
                "use layout.routing attention"
            )
        m = m.contiguous() if self.exchange_dtype == "same" else quantize(m, self.exchange_dtype)
        T = m.shape[0]
        works, bufs = [], []
        for f in self.ffn_ranks:
            works.append((f, self.plane.isend(m, f), f"layer {layer} MoE input send"))
            buf = self.pool.get((micro_batch, f), T, self.hidden)
            works.append((f, self.plane.irecv(buf, f), f"layer {layer} MoE output receive"))
            bufs.append(buf)
        self.exchange_bytes["to_ffn"] += m.numel() * m.element_size() * len(self.ffn_ranks)
        self.exchange_bytes["to_attention"] += sum(b.numel() * b.element_size() for b in bufs)
        return _RemoteHandle(self, works, bufs, m)

    def end_step(self) -> ExchangeStats:
        self._wait_headers()
        return self.totals() - self._begun

    def _wait_headers(self) -> None:
        for peer, work, what in self._header_sends:
            self.plane.wait(work, peer, what)
        self._header_sends = []

    def check(self) -> None:
        self.plane.check()

    def idle(self) -> int:
        """An empty step: tells the FFN nodes this node is alive; returns how many attention nodes had
        work in the FFN step this joined (0: the whole cluster is idle)."""
        self._send_header((), FLAG_IDLE)
        works = [(f, self.plane.irecv(self._acks[f], f)) for f in self.ffn_ranks]
        for f, w in works:
            self.plane.wait(w, f, "idle ack receive")
        self._wait_headers()
        busiest = torch.stack([buf[0] for buf in self._acks.values()]).max()
        return host_syncs.to_int(busiest)  # one read, not one per FFN node

    def leave(self, shutdown: bool = False) -> None:
        """Tell every FFN node this attention node is done (with `shutdown`, that they exit)."""
        flags = FLAG_LEAVE | (FLAG_SHUTDOWN if shutdown else 0)
        self._send_header((), flags)
        self._wait_headers()
