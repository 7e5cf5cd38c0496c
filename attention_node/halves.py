"""What every rank of an attention node builds in its process from its loaded halves (afd.engine.load.Halves):
its share of the attention half, its TP group, and the way it reaches the MoE (the FFN nodes, or its own copy
of the experts in a cluster without FFN nodes)."""

from __future__ import annotations

import logging

from afd.dataplane.dispatch import RoutedMoE, RouteTable
from afd.dataplane.exchange import LocalMoE, MoEExchange, RemoteMoE
from afd.engine.load import Halves
from afd.model.halves import AttentionHalf
from afd.model.tp.comm import SINGLE, TPComm
from afd.model.tp.shard import shard_attention_half

log = logging.getLogger("afd.attention")


def tp_group(rt):
    """This rank's TP group (once the data plane is up); build_rank cuts the attention half to its share."""
    cfg = rt.cfg
    if cfg.layout.attention_tp == 1:
        return SINGLE
    # ranks of the node's own TP world (afd.node.tp_world)
    tp = TPComm(cfg.layout.tp, rt.tp_rank, list(range(cfg.layout.attention_tp)), rt.backend, cfg.cluster.comm_timeout)
    log.info("TP rank %d of %d (tp_comm %s)", rt.tp_rank, tp.size, cfg.layout.tp_comm)
    return tp


def build_rank(rt, built: Halves, dtype) -> tuple[AttentionHalf, TPComm, MoEExchange]:
    """(attention half cut to this rank, TP group, MoE exchange) after bring_up."""
    tp = tp_group(rt)
    attn = shard_attention_half(built.attn, tp)
    return attn, tp, exchange(rt, built, dtype)


def exchange(rt, built: Halves, dtype) -> MoEExchange:
    """How this rank reaches the MoE on the current data plane: the FFN nodes, or its own experts."""
    cfg, mcfg = rt.cfg, rt.model_cfg
    if cfg.colocated:
        assert built.ffn is not None  # Halves.load loads every expert where the cluster has no FFN nodes
        return LocalMoE(built.ffn, rt.backend)
    if cfg.routing == "attention":
        holdings = {r: rt.plane.link(r).experts for r in rt.plane.peers}  # what each FFN node said it holds
        table = RouteTable(holdings, mcfg.n_routed_experts, rt.backend.device)
        return RoutedMoE(
            rt.plane, built.ffn, rt.backend, table, mcfg.hidden_size, dtype, exchange_dtype=cfg.layout.exchange_dtype
        )
    return RemoteMoE(
        rt.plane,
        rt.plane.peers,
        rt.model_cfg.hidden_size,
        dtype,
        rt.backend.device,
        exchange_dtype=rt.cfg.layout.exchange_dtype,
    )
