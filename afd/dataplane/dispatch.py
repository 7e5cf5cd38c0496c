"""layout.routing attention: the attention rank routes, and sends each token only to the FFN nodes that
hold one of its chosen experts (the wire format: afd.dataplane.protocol).

Per (layer, micro-batch) of T tokens, K experts per token, F live FFN nodes:

    weights, ids = router(m)                     # [T, K] fp32, [T, K]: the family's own router
    node = holder(ids)                           # [T, K]: the FFN node computing each slot; -1 identity
    y0 = m * sum(weights where identity)         # identity experts never cross
    to f: the rows with a slot on f, their ids (-1 where another node computes the slot) and weights
    y = y0 + sum_f scatter(rows_f, y_f)          # y_f: f's weighted partial of each row it got

A replicated expert's slots go to its live holders by token (t + a per-call offset, mod its replicas),
which splits its tokens evenly. The rows each node gets are known once routing is: one read of the
[F] counts per layer and micro-batch on the host, so that each message is exactly its rows (the capacity
alternative, a fixed-size buffer per node, would have to hold all T rows to never drop a token, which is
broadcast's bytes: docs/benchmarks/dispatch.md).
"""

from __future__ import annotations

import torch

from afd.backend import Backend, host_syncs
from afd.dataplane.exchange import MoEHandle, RemoteMoE
from afd.dataplane.protocol import dispatch_bytes, pack_rows, quantize
from afd.dataplane.transport import DataPlane
from afd.observability.timing import Timers


class Unserved(ValueError):
    """Some routed expert has no live holder: its tokens cannot be routed until a holder forms its pair."""


class RouteTable:
    """Where each routed expert's slots go: its live holders, as positions in `ranks`."""

    def __init__(self, holdings: dict[int, tuple[int, ...]], n_routed: int, device: torch.device):
        """holdings: live FFN node's data-plane rank -> the routed experts it holds (what it said when its
        pair formed: PairLink.experts). Raises Unserved when an expert has no holder among them."""
        self.ranks = sorted(holdings)
        """The live FFN nodes' data-plane ranks, ascending: the order partials are added in."""
        self.holdings = {r: tuple(holdings[r]) for r in self.ranks}
        E = n_routed
        holders = [[i for i, r in enumerate(self.ranks) if e in self.holdings[r]] for e in range(E)]
        missing = [e for e in range(E) if not holders[e]]
        if missing:
            raise Unserved(f"routed expert(s) {_ids(missing)} have no live FFN node (live: ranks {self.ranks})")
        R = max(len(h) for h in holders)
        reps = torch.tensor([h + [h[0]] * (R - len(h)) for h in holders], dtype=torch.int64)  # [E, R]
        self.reps = reps.to(device)
        self.count = torch.tensor([len(h) for h in holders], dtype=torch.int64, device=device)  # [E]
        self.n_routed = E

    def assign(self, ids: torch.Tensor, offset: int) -> torch.Tensor:
        """ids [T, K] -> node [T, K]: the position (in `ranks`) of the node computing each slot, -1 for
        identity experts."""
        T = ids.shape[0]
        routed = ids < self.n_routed
        e = ids.clamp(max=self.n_routed - 1)
        token = torch.arange(T, device=ids.device)[:, None] + offset  # [T, 1]
        j = token % self.count[e]  # [T, K]: which replica
        return torch.where(routed, self.reps[e, j], -1)


def _ids(experts: list[int]) -> str:
    return ", ".join(map(str, experts[:16])) + (f" and {len(experts) - 16} more" if len(experts) > 16 else "")


class _RoutedHandle:
    def __init__(self, owner: RoutedMoE, works: list, y0: torch.Tensor, parts: list, keep: list):
        self.owner, self.works, self.y0, self.parts, self.keep = owner, works, y0, parts, keep

    def wait(self) -> torch.Tensor:
        self.owner.wait_all(self.works)
        self.keep = []
        y = self.y0
        for rows, buf in self.parts:  # FFN nodes' partials added in rank order
            y.index_add_(0, rows, buf)
        return y


class RoutedMoE(RemoteMoE):
    """The MoE half on FFN nodes with the router here (layout.routing attention)."""

    def __init__(
        self,
        plane: DataPlane,
        routers,
        backend: Backend,
        table: RouteTable,
        hidden: int,
        dtype: torch.dtype,
        timers: Timers | None = None,
        exchange_dtype: str = "same",
    ):
        """routers: an FFN half holding no experts (afd.model.halves.FFNHalf with experts=()): each MoE
        layer's router, the MTP module's too. table: the live FFN nodes and their experts."""
        super().__init__(plane, table.ranks, hidden, dtype, backend.device, timers, exchange_dtype)
        self.routers, self.backend, self.table, self.dtype = routers, backend, table, dtype
        self._calls = 0

    def adopt(self, rank: int, experts: tuple[int, ...]) -> None:
        """At a step boundary: a newly formed pair with FFN node `rank` (a dead node's replacement) takes its
        share of the routing from the next step on; the other pairs' steps go on counting."""
        holdings = {**self.table.holdings, rank: experts}
        self.table = RouteTable(holdings, self.table.n_routed, self.pool.device)
        self.ffn_ranks = self.table.ranks
        self._add_peer(rank)

    def submit(self, layer: int, micro_batch: int, m: torch.Tensor, **kw) -> MoEHandle:
        """kw: `token_ids` [T] for a router that reads them (DeepSeek-V4's hash layers): it runs here."""
        m = m.contiguous()
        with torch.inference_mode():
            weights, ids = self.routers.layer(layer).router(m, self.backend, **kw)  # [T, K] each
        T, K = ids.shape
        E = self.table.n_routed
        node = self.table.assign(ids, self._calls)  # [T, K]
        self._calls += 1
        zero_w = (weights * (ids >= E)).sum(dim=-1, keepdim=True)  # [T, 1]: the identity experts' share
        y0 = (m * zero_w).to(m.dtype)
        F = len(self.table.ranks)
        mine = node[None] == torch.arange(F, device=m.device)[:, None, None]  # [F, T, K]
        wanted = mine.any(dim=-1)  # [F, T]
        # [F + 1] on the device: each node's rows (what its count message carries), then the identity slots
        counts = torch.cat([wanted.sum(dim=1), (ids >= E).sum().view(1)])
        n = host_syncs.to_list(counts)  # one read per layer and micro-batch: the messages' sizes
        self.zero_slots += n[F]
        order = torch.argsort((~wanted).to(torch.int8), dim=1, stable=True)  # [F, T]: each node's rows first
        x = m if self.exchange_dtype == "same" else quantize(m, self.exchange_dtype)
        works, parts, keep = [], [], [counts]
        for f, rank in enumerate(self.table.ranks):
            works.append((rank, self.plane.isend(counts[f : f + 1], rank), f"layer {layer} MoE count send"))
            if n[f] == 0:
                continue
            rows = order[f, : n[f]]  # [n_f]
            own = mine[f][rows]  # [n_f, K]
            packed = pack_rows(x[rows], torch.where(own, ids[rows], -1), torch.where(own, weights[rows], 0.0))
            buf = self.pool.get((micro_batch, rank), n[f], self.hidden)
            works.append((rank, self.plane.isend(packed, rank), f"layer {layer} MoE rows send"))
            works.append((rank, self.plane.irecv(buf, rank), f"layer {layer} MoE output receive"))
            parts.append((rows, buf))
            keep.append(packed)
        sent = dispatch_bytes(n[:F], self.hidden, self.dtype, K, self.exchange_dtype)
        for d, b in sent.items():
            self.exchange_bytes[d] += b
        return _RoutedHandle(self, works, y0, parts, keep)
