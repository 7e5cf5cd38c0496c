"""`AttentionNode`: one process of an attention node — rank 0 or one of its TP ranks — whatever it runs.

It holds what every such process has: its place in the cluster (`runtime`, after bring-up), what it
loaded (`halves`), its share of the attention half (`attn`), its TP group (`tp`) and its way to the MoE
(`moe`). The roles built on it say what `serve` runs: the HTTP API (serving_node.ServingNode), what
rank 0 sends (tp_rank.TPRankNode), or offline jobs (worker.OfflineNode).
"""

from __future__ import annotations

import logging
import time

import torch

from afd.config.schema import ClusterConfig
from afd.control.client import ControlError
from afd.dataplane.dispatch import RoutedMoE, Unserved
from afd.dataplane.exchange import MoEExchange
from afd.engine.load import Halves
from afd.model.config import parse_dtype
from afd.model.halves import AttentionHalf
from afd.model.tp.comm import SINGLE, TPComm
from afd.node.adoption import Adopter
from afd.node.runtime import NodeRuntime, bring_up
from attention_node.halves import build_rank, exchange

log = logging.getLogger("afd.attention")
UNSERVED_RETRY_S = 1.0


class AttentionNode:
    def __init__(self, cfg: ClusterConfig, args, tp_rank: int = 0):
        self.cfg, self.args, self.tp_rank = cfg, args, tp_rank
        self.dtype: torch.dtype = parse_dtype(cfg.model.dtype)
        self.runtime: NodeRuntime | None = None
        self.halves: Halves | None = None
        self.attn: AttentionHalf | None = None
        self.tp: TPComm = SINGLE
        self.moe: MoEExchange | None = None
        self.adopter: Adopter | None = None
        """Brings back FFN nodes the last re-formation left out (afd.node.adoption)."""

    @property
    def rt(self) -> NodeRuntime:
        """`runtime`, once start() brought the node up."""
        assert self.runtime is not None  # set by start()
        return self.runtime

    @property
    def loaded(self) -> Halves:
        """`halves`, once start() loaded them."""
        assert self.halves is not None  # set by _load, which bring_up calls in start()
        return self.halves

    @property
    def half(self) -> AttentionHalf:
        """`attn`, once start() cut it to this rank."""
        assert self.attn is not None  # set by start()
        return self.attn

    @property
    def live_moe(self) -> MoEExchange:
        """`moe`, the exchange in use: set by start(), and again by each reform()."""
        assert self.moe is not None  # set by start() and reform()
        return self.moe

    def start(self) -> None:
        self.runtime = bring_up(
            self.cfg, self.args.node, self.args.bind_host, self._load, self._on_status, tp_rank=self.tp_rank
        )
        try:
            self.attn, self.tp, self.moe = build_rank(self.runtime, self.loaded, self.dtype)
        except BaseException:  # e.g. a layout this rank cannot cut: the control server goes with it
            self.runtime.close(plane=False)
            raise

    def _load(self, rt: NodeRuntime) -> None:
        self.halves = Halves.load(rt.cfg, rt.model_path, rt.model_cfg, rt.backend)

    def _on_status(self, status) -> None:
        """Each heartbeat's cluster status (None: the coordinator did not answer)."""

    def reform(self, why: str) -> MoEExchange:
        """This rank's pairs of the data plane formed again (afd.node.runtime.NodeRuntime.reform); the
        node's TP ranks, which meet the failure too, meet again in a new TP world (afd.node.tp_world)."""
        self.moe = None  # the old exchange's pairs go
        if self.adopter is not None:  # this re-formation tries every FFN node itself
            for _, link in self.adopter.close():
                link.close(queued=True)
            self.adopter = None
        rt = self.rt
        world = rt.tp_world
        if world is not None:
            # the TP groups go first: a rank still blocked in one of their collectives fails at once
            self.tp.disconnect()
            world.leave()
        rt.reform(why, self._covered() if world is None else None)
        if world is not None:
            world.form(self.cfg.cluster.rejoin_timeout)
            self.tp.connect()
        self.moe = self._exchange(why)
        if rt.left_out:
            plane = rt.plane
            assert plane is not None  # formed again just now (rt.reform)
            self.adopter = Adopter(rt.left_out, rt.client.ref, plane.rank, rt.backend, rt.shutdown)
        return self.moe

    def _exchange(self, why: str) -> MoEExchange:
        """The exchange over the pairs just formed. Every FFN node formed but some routed expert has no holder
        among them: a placement change is under way (afd rebalance --apply restarts the FFN nodes one at a
        time, and the one that will hold it has not yet), so the pairs form again until the experts are
        served, within cluster.rejoin_timeout; requests stay paused, none fails."""
        rt = self.rt
        deadline = time.monotonic() + self.cfg.cluster.rejoin_timeout
        while True:
            try:
                return exchange(rt, self.loaded, self.dtype)
            except Unserved as e:
                if time.monotonic() > deadline:
                    raise ControlError(
                        f"{e}, for {self.cfg.cluster.rejoin_timeout:g}s (cluster.rejoin_timeout)"
                    ) from None
                log.warning("%s: forming the pairs again until a node holds them", e)
                time.sleep(UNSERVED_RETRY_S)
                rt.reform(why)

    def _covered(self):
        """Under routing attention: whether the pairs formed so far hold every routed expert, so that an FFN
        node that is down need not be waited for (its replicas take its tokens). None otherwise. Not under
        attention TP, whose ranks form their pairs with an FFN node together (ffn_node/pairs.py)."""
        if self.cfg.routing != "attention":
            return None
        n = self.rt.model_cfg.n_routed_experts

        def covered(plane) -> bool:
            held = {e for r in plane.peers for e in plane.link(r).experts}
            return len(held) == n

        return covered

    def adopt(self) -> MoEExchange | None:
        """At a step boundary: pairs the adopter formed with FFN nodes that are back (a dead node's
        replacement), taken into the plane and the exchange; the exchange when any was, else None."""
        if self.adopter is None:
            return None
        formed = self.adopter.take()
        assert isinstance(self.moe, RoutedMoE)  # only routing attention leaves a node out
        plane = self.rt.plane
        for peer, link in formed:
            assert plane is not None  # the adopter's pairs join the plane reform() formed
            plane.add(peer.rank, link)
            self.moe.adopt(peer.rank, link.experts)
        return self.moe if formed else None

    def serve(self) -> int:
        raise NotImplementedError

    def stop(self) -> None:
        """From the signal thread: another thread may be blocked in the data plane, so the plane is left
        to the process's exit."""
        if self.runtime is not None:
            self.runtime.close(plane=False)

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.close()
