"""`AttentionNode`: one process of an attention node — rank 0 or one of its TP ranks — whatever it runs.

It holds what every such process has: its place in the cluster (`runtime`, after bring-up), what it
loaded (`halves`), its share of the attention half (`attn`), its TP group (`tp`) and its way to the MoE
(`moe`). The roles built on it say what `serve` runs: the HTTP API (serving_node.ServingNode), what
rank 0 sends (tp_rank.TPRankNode), or offline jobs (worker.OfflineNode).
"""

from __future__ import annotations

import logging

import torch

from afd.cluster.config import ClusterConfig
from afd.dataplane.exchange import MoEExchange
from afd.model.config import parse_dtype
from afd.model.tp.comm import SINGLE, TPComm
from afd.node.runtime import NodeRuntime, bring_up
from attention_node.halves import Halves, build_rank, exchange, load_halves

log = logging.getLogger("afd.attention")


class AttentionNode:
    def __init__(self, cfg: ClusterConfig, args, tp_rank: int = 0):
        self.cfg, self.args, self.tp_rank = cfg, args, tp_rank
        self.dtype: torch.dtype = parse_dtype(cfg.model.dtype)
        self.runtime: NodeRuntime | None = None
        self.halves: Halves | None = None
        self.attn = None
        self.tp: TPComm = SINGLE
        self.moe: MoEExchange | None = None

    def start(self) -> None:
        self.runtime = bring_up(
            self.cfg, self.args.node, self.args.bind_host, self._load, self._on_status, tp_rank=self.tp_rank
        )
        try:
            self.attn, self.tp, self.moe = build_rank(self.runtime, self.halves, self.dtype)
        except BaseException:  # e.g. a layout this rank cannot cut: the control server goes with it
            self.runtime.close(plane=False)
            raise

    def _load(self, rt: NodeRuntime) -> None:
        self.halves = load_halves(rt, self.dtype)

    def _on_status(self, status) -> None:
        """Each heartbeat's cluster status (None: the coordinator did not answer)."""

    def reform(self, why: str) -> MoEExchange:
        """This rank's pairs of the data plane formed again (afd.node.runtime.NodeRuntime.reform); the
        node's TP ranks, which meet the failure too, meet again in a new TP world (afd.node.tp_world)."""
        self.moe = None  # the old exchange's pairs go
        world = self.runtime.tp_world
        if world is not None:
            # the TP groups go first: a rank still blocked in one of their collectives fails at once
            self.tp.disconnect()
            world.leave()
        self.runtime.reform(why)
        if world is not None:
            world.form(self.cfg.cluster.rejoin_timeout)
            self.tp.connect()
        self.moe = exchange(self.runtime, self.halves, self.dtype)
        return self.moe

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
