"""One rank's view of its attention node's TP group: the collectives each mode makes, and their bytes.

The residual stream of a micro-batch is either replicated (allreduce, or a sharded mode below its
threshold) or a token shard: rank r holds rows [r*s, (r+1)*s) of the T tokens padded to G*s. Layers see
only these calls: `gather` (stream -> every token, before a column-parallel layer), `row_parallel` /
`fc2_o_proj` (a partial product -> the stream), the embedding's `reduce` and the head's `gather_vocab`;
KVP's `kvp_merge`; and `moe_rows` / `moe_output`, the rows this rank exchanges with the FFN side. They
follow `active`, the plan of the micro-batch being worked on: the runner scopes each call into the model
with `with tp.plan(p):`, since micro-batches interleave.

Bytes are counted per rank as the bandwidth-optimal algorithm sends them: AllReduce 2(G-1)/G of the
tensor, ReduceScatter and AllGather (G-1)/G of the full tensor, all_to_all (D-1)/D of the input
(afd/model/tp/volume.py states the same per layer by formula).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from afd.backend.base import PeerError, to_device
from afd.backend.deadlines import Deadlines
from afd.config.tp import ShardPlan, TPConfig, fc2_batch_ids, fc2_groups, plan

log = logging.getLogger("afd.tp")
# torch 2.13 renamed the tensor-in/tensor-out collectives; the old names still work before it
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class TPError(PeerError):
    """A collective of the TP group failed or timed out: a rank of this attention node is gone (or the
    data plane it lives in was torn down to re-form)."""


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else F.pad(x, (0, 0) * (x.dim() - 1) + (0, rows - x.shape[0]))


class TPComm:
    def __init__(
        self, cfg: TPConfig, rank: int = 0, ranks: list[int] | None = None, backend=None, timeout_s: float = 60.0
    ):
        """ranks: the group's global ranks in TP-rank order (ranks[0] leads: it schedules and samples).
        Groups are made by their members only, so other processes of the world need not take part."""
        self.cfg, self.rank, self.size = cfg, rank, cfg.size
        self.ranks = ranks or [0]
        self.backend = backend
        self.active = plan(cfg, 0)
        """The plan the collectives follow (set by `plan`)."""
        self.bytes: Counter = Counter()
        """Bytes this rank sent, by collective (afd_tp_comm_bytes_total)."""
        self.fallbacks: Counter = Counter()
        """Micro-batches a sharded mode ran as allreduce, below its token threshold."""
        self.timeout_s = timeout_s
        self.deadlines: Deadlines | None = None
        """On NCCL/HCCL (stream-ordered waits) the collectives' deadlines, held off the hot path as the data
        plane's are (afd.backend.deadlines); None where a wait blocks the host until its timeout (gloo)."""
        if self.size > 1:
            self.connect()

    def connect(self) -> None:
        """Makes the group's process groups in the node's TP world: at start-up, and again in the next world
        after a failure re-formed the node's pairs (`disconnect` ended the old groups). Layers keep this
        object, so they follow."""
        cfg, rank = self.cfg, self.rank
        ordered = self.backend is not None and self.backend.stream_ordered_waits
        # With the watchdog holding the deadlines, the groups' own timeout is a backstop past it (as the data
        # plane's: afd.dataplane.transport); the object collectives' gloo group keeps the deadline itself.
        timeout = timedelta(seconds=self.timeout_s * 2 + 10 if ordered else self.timeout_s)
        if self.deadlines is not None:  # a re-form: the old groups were ended
            self.deadlines.close()
        self.deadlines = Deadlines(self.timeout_s, self._abort, error=self._timed_out) if ordered else None

        def group(members: list[int], **kw):
            return dist.new_group(
                [self.ranks[i] for i in members], timeout=timeout, use_local_synchronization=True, **kw
            )

        self.group = group(list(range(self.size)))
        self.cpu_group = dist.new_group(
            self.ranks, timeout=timedelta(seconds=self.timeout_s), use_local_synchronization=True, backend="gloo"
        )  # schedules, as pickled objects
        if cfg.kvp > 1:  # consecutive ranks: head group rank // N, KV rank rank % N
            first = rank - rank % cfg.kvp
            self.kvp_group = group(list(range(first, first + cfg.kvp)))
        if cfg.mode == "flashcomm2":
            odp, otp = fc2_groups(self.size, cfg.fc2_otp)
            self.odp_group = group(next(g for g in odp if rank in g))
            self.otp_group = group(next(g for g in otp if rank in g))

    def disconnect(self) -> None:
        """Drops this rank's groups when the node re-forms after a failure, aborting their communicators
        (NCCL, HCCL: without waiting for queued work); the node's TP world then goes with them
        (afd.node.tp_world.TPWorld.leave), so a rank of this node still blocked in one of their collectives
        fails at once, not at its timeout. `connect` makes new ones in the next world."""
        for name in ("group", "cpu_group", "kvp_group", "odp_group", "otp_group"):
            group = getattr(self, name, None)
            if group is None:
                continue
            setattr(self, name, None)
            if self.backend is not None and name != "cpu_group":
                try:
                    self.backend.abort_group(group)
                except Exception as e:  # noqa: BLE001 (a dead rank can make an abort fail; re-forming matters more)
                    log.debug("TP group %s abort: %s", name, e)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # ---- plans -------------------------------------------------------------------------------------

    def plan_for(self, tokens: int) -> ShardPlan:
        p = plan(self.cfg, tokens)
        if self.size > 1 and self.cfg.mode != "allreduce" and not p.sharded and tokens:
            if not self.fallbacks:
                log.info(
                    "tp_comm %s: a micro-batch of %d tokens runs as allreduce (below the threshold of %d; "
                    "afd_tp_comm_fallbacks_total counts each)",
                    self.cfg.mode,
                    tokens,
                    self.cfg.threshold,
                )
            log.debug("tp_comm %s -> allreduce for %d tokens", self.cfg.mode, tokens)
            self.fallbacks[self.cfg.mode] += 1
        return p

    @contextmanager
    def plan(self, p: ShardPlan) -> Iterator[None]:
        """The collectives inside follow `p`; the previous plan is back on exit."""
        prev, self.active = self.active, p
        try:
            yield
        finally:
            self.active = prev

    # ---- collectives -------------------------------------------------------------------------------

    def _run(self, op: str, nbytes: int, fn, *args, **kw) -> None:
        """One collective. On NCCL/HCCL it is stream-ordered: issued asynchronously, waited for on the
        stream (the host goes on), its deadline held by the watchdog; `check` raises a passed one."""
        try:
            if self.deadlines is not None and op != "schedule":
                work = fn(*args, async_op=True, **kw)
                self.deadlines.watch(work, 0, op)
                try:
                    work.wait()
                except RuntimeError:
                    self.deadlines.check()  # the watchdog's abort ended it: say that its deadline passed
                    raise
            else:
                fn(*args, **kw)
        except TPError:
            raise
        except RuntimeError as e:
            line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TPError(
                f"tensor parallel: {op} in the TP group (ranks {self.ranks}) failed ({line}); a rank "
                "of this attention node is probably gone"
            ) from None
        self.bytes[op] += nbytes

    def check(self) -> None:
        """Raises the TPError of a collective whose deadline passed (its groups are aborted by then): the
        engine calls it after each step's host read, as it does the data plane's."""
        if self.deadlines is not None:
            self.deadlines.check()

    def _timed_out(self, what: str, peer: int, timeout_s: float) -> TPError:
        return TPError(
            f"tensor parallel: {what} in the TP group (ranks {self.ranks}) timed out after {timeout_s:.0f}s; a "
            "rank of this attention node is probably gone"
        )

    def _abort(self, _peer: int) -> None:
        """The watchdog's: aborts every device group of this TP group, so the work queued on them fails
        instead of hanging (a finalized group would wait for it: afd.backend's abort_group)."""
        for name in ("group", "kvp_group", "odp_group", "otp_group"):
            pg = getattr(self, name, None)
            if pg is not None and self.backend is not None:
                self.backend.abort_group(pg)

    def _share(self, n: int, parts: int) -> int:
        return n * (parts - 1) // parts

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The stream (or anything per token of it) -> all T tokens' rows."""
        return self._gather_rows(x) if self.active.sharded else x

    def _gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's [shard, ...] rows -> the micro-batch's [T, ...] (padding dropped)."""
        out = x.new_empty(self.active.padded, *x.shape[1:])
        self._run(
            "all_gather",
            self._share(out.numel() * out.element_size(), self.size),
            _all_gather,
            out,
            x.contiguous(),
            group=self.group,
        )
        return out[: self.active.tokens]

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """A partial sum over all T tokens -> the stream: AllReduce, or ReduceScatter onto the shard."""
        p = self.active
        if self.size == 1:
            return y
        if not p.sharded:
            self._run(
                "all_reduce",
                2 * self._share(y.numel() * y.element_size(), self.size),
                dist.all_reduce,
                y,
                group=self.group,
            )
            return y
        y = _pad_rows(y, p.padded).contiguous()
        out = y.new_empty(p.shard, *y.shape[1:])
        self._run(
            "reduce_scatter",
            self._share(y.numel() * y.element_size(), self.size),
            _reduce_scatter,
            out,
            y,
            group=self.group,
        )
        return out

    def row_parallel(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, K/G] @ weight[H, K/G]^T summed over the group, into the stream's layout."""
        p = self.active
        if self.size > 1 and p.sharded and self.backend is not None:
            xp = _pad_rows(x, p.padded)
            fused = self.backend.mm_reduce_scatter(xp, weight, self.group, self.size)
            if fused is not None:
                self.bytes["reduce_scatter"] += self._share(p.padded * weight.shape[0] * x.element_size(), self.size)
                return fused if bias is None else fused + bias
        y = self.reduce(F.linear(x, weight))
        return y if bias is None else y + bias

    def fc2_o_proj(self, x: torch.Tensor, block: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """FlashComm2's o_proj. x [T, F/G] (this rank's heads), block [H, F/P] (the columns of this rank's
        ODP group). Returns this rank's token shard [s, H]."""
        p, G, P = self.active, self.size, self.cfg.fc2_otp
        D, s, Fl = G // P, p.shard, x.shape[1]
        order = to_device(torch.tensor(fc2_batch_ids(G, P)), x.device).reshape(-1)  # member i's chunks, i = 0..D-1
        send = _pad_rows(x, p.padded).view(G, s, Fl)[order].view(D, P, s, Fl)  # [D (to member i), P, s, Fl]
        recv = torch.empty_like(send)  # [D (from member i), P, s, Fl]: member i's heads for my chunks
        self._run(
            "all_to_all",
            self._share(send.numel() * send.element_size(), D),
            dist.all_to_all_single,
            recv,
            send,
            group=self.odp_group,
        )
        inp = recv.permute(1, 2, 0, 3).reshape(P * s, D * Fl)  # my chunks, the ODP group's heads side by side
        partial = (inp @ block.t()).contiguous()  # [P*s, H]
        out = partial.new_empty(s, partial.shape[1])
        self._run(
            "reduce_scatter",
            self._share(partial.numel() * partial.element_size(), P),
            _reduce_scatter,
            out,
            partial,
            group=self.otp_group,
        )
        return out if bias is None else out + bias

    def kvp_merge(self, o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """o [T, N*n, v] and lse [T, N*n] (this rank's partials for its head group's heads) -> [T, n, v]:
        the merged attention of this rank's own n heads (afd/model/kvp.py)."""
        from afd.model.kvp import merge

        N, (T, hg, v) = self.cfg.kvp, o.shape
        send_o = o.view(T, N, hg // N, v).transpose(0, 1).contiguous()  # [N, T, n, v]: piece j to KV rank j
        send_l = lse.view(T, N, hg // N).transpose(0, 1).contiguous()
        recv_o, recv_l = torch.empty_like(send_o), torch.empty_like(send_l)
        for send, recv in ((send_o, recv_o), (send_l, recv_l)):
            self._run(
                "all_to_all",
                self._share(send.numel() * send.element_size(), N),
                dist.all_to_all_single,
                recv,
                send,
                group=self.kvp_group,
            )
        return merge(recv_o, recv_l)

    # ---- the MoE boundary --------------------------------------------------------------------------

    def moe_rows(self) -> tuple[int, int]:
        """The rows of the stream this rank exchanges with the MoE: its real shard rows when sharded
        ([0, n) of its shard), else its slice [lo, hi) of the replicated tokens."""
        lo, hi = self.active.span(self.rank)
        return (0, hi - lo) if self.active.sharded else (lo, hi)

    def moe_output(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's MoE output rows -> the stream: padded to the shard, or gathered from every rank."""
        p = self.active
        if self.size == 1:
            return y
        y = _pad_rows(y, p.shard)
        return y if p.sharded else self._gather_rows(y)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V/G] of this rank's vocabulary slice -> [B, V_padded] on every rank."""
        if self.size == 1:
            return logits
        B, Vl = logits.shape
        out = logits.new_empty(self.size * B, Vl)
        self._run(
            "all_gather",
            self._share(out.numel() * out.element_size(), self.size),
            _all_gather,
            out,
            logits.contiguous(),
            group=self.group,
        )
        return out.view(self.size, B, Vl).transpose(0, 1).reshape(B, self.size * Vl)

    # ---- the leader's schedule ---------------------------------------------------------------------

    def send_step(self, msg: object) -> None:
        """The leader tells the other ranks what to run next (they run it in lockstep)."""
        self._run("schedule", 0, dist.broadcast_object_list, [msg], src=self.ranks[0], group=self.cpu_group)

    def recv_step(self) -> object:
        box: list[Any] = [None]
        self._run("schedule", 0, dist.broadcast_object_list, box, src=self.ranks[0], group=self.cpu_group)
        return box[0]


SINGLE = TPComm(TPConfig())
"""The comm of an attention node of one rank: every call is the identity."""
