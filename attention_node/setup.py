"""Builds a serving attention node's state over its loaded rank: metrics, KV cache sized from the budget, engine."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING

import torch

from afd.cluster.config import EngineSection
from afd.cluster.topology import served_model_name
from afd.control import control_pb2 as pb
from afd.engine.engine import Engine
from afd.engine.graph import GraphSettings, settings_of, wrap
from afd.engine.kv_cache import CacheConfig, KVCache
from afd.engine.membership import PlaneMembership
from afd.engine.runner import ModelRunner
from afd.engine.scheduler import Scheduler
from afd.engine.tokenizer import load_tokenizer
from afd.model.tp.comm import SINGLE
from afd.observability.metrics import AttentionMetrics
from attention_node.api_server import ServerState
from attention_node.openai_protocol import Limits

if TYPE_CHECKING:
    from attention_node.node import AttentionNode

log = logging.getLogger("afd.attention")
# DEGRADED (some node missed heartbeats) still serves: a lost FFN peer shows up in this node's own data
# plane (the engine dies and /health says 503), and a lost attention node is no reason to stop this one.
_SERVING = (pb.ClusterStatus.READY, pb.ClusterStatus.DRAINING, pb.ClusterStatus.DEGRADED)


def serving_state(node: AttentionNode) -> ServerState:
    """What rank 0 of a serving node serves the API from, once the node is up: metrics, the engine
    (re-forming through the node when a peer fails, with cluster.rejoin_timeout > 0) and limits."""
    cfg, args, rt = node.cfg, node.args, node.runtime
    mcfg = rt.model_cfg
    name = served_model_name(cfg.model.path, args.served_model_name)
    metrics = AttentionMetrics(args.node, name)
    metrics.watch_cluster_state(lambda: rt.cluster_state)
    metrics.watch_tp(node.tp)
    engine, tok, max_len = build_engine(
        node.attn,
        node.moe,
        rt.model_path,
        mcfg,
        node.dtype,
        rt.backend.device,
        cfg.engine,
        cfg.model.max_model_len,
        args,
        metrics,
        cfg.layout.micro_batches,
        cfg.layout.overlap,
        node.tp,
        node.halves.mtp,
        graph=settings_of(cfg),
        backend=rt.backend,
    )
    engine.membership = PlaneMembership(
        node.reform if cfg.cluster.rejoin_timeout > 0 else None, rt.superseded, rt.release_plane
    )
    return ServerState(
        engine,
        tok,
        name,
        rt.model_path,
        Limits(max_len, mcfg.vocab_size),
        metrics,
        ready=lambda: rt.cluster_state in _SERVING,
        api_key=args.api_key,
    )


def kv_cache_for(mcfg, dtype, device, eng: EngineSection, kvp: int = 1) -> KVCache:
    """The KV cache a serving attention rank sizes from its budget (every TP rank alike: block tables
    come from the leader). MLA's latent cache is the same on every rank, or with KVP each rank holds its
    1/kvp share of a node-wide cache kvp times the budget's blocks."""
    cache = CacheConfig(block_size=eng.block_size, memory_budget_bytes=eng.kv_cache_bytes)
    return KVCache(mcfg, kvp * cache.resolve_num_blocks(mcfg, dtype.itemsize), eng.block_size, dtype, device, kvp)


def build_engine(
    attn,
    moe,
    model_path: str,
    mcfg,
    dtype,
    device,
    eng: EngineSection,
    max_model_len: int | None,
    args,
    metrics: AttentionMetrics,
    micro_batches: int = 1,
    overlap: bool = True,
    tp=SINGLE,
    mtp=None,
    graph: GraphSettings | None = None,
    backend=None,
):
    """The serving engine over an attention half and its MoE exchange (remote or colocated): KV cache
    sized from the budget, tokenizer with `--chat-template`, `--seed`; with engine.speculative_tokens,
    MTP drafting with the MTP module `mtp` (its KV cache layer taken from the same budget); graph mode
    per `graph` (afd.engine.graph, compiled by `backend`). Returns (engine, tokenizer, max_model_len)."""
    kv = kv_cache_for(mcfg, dtype, device, _without_mtp_layer(eng, mcfg, mtp), tp.cfg.kvp)
    attn = wrap(attn, kv, graph, tp, backend)  # graph mode takes its scratch block from the cache
    metrics.watch_graph(attn)
    num_blocks = kv.allocator.num_free  # what requests can have
    max_len = min(max_model_len or mcfg.max_position_embeddings, num_blocks * eng.block_size)
    log.info(
        "KV cache: %d blocks of %d tokens (%.1f MiB); max_model_len %d",
        num_blocks,
        eng.block_size,
        kv.data.numel() * kv.data.element_size() / 2**20,
        max_len,
    )
    runner = ModelRunner(attn, moe, kv, device, micro_batches, overlap, tp, mtp if eng.speculative_tokens else None)
    metrics.watch_kv_ranks(kv.allocator)
    tok = load_tokenizer(model_path)
    if args.chat_template:
        if tok is None:
            raise ValueError(f"--chat-template: {model_path} has no tokenizer.json to render a template for")
        tok.set_chat_template(args.chat_template)
    if args.seed is not None:  # requests without a seed of their own sample from torch's default generator
        torch.manual_seed(args.seed)
    eos = tok.eos_token_ids if tok is not None and tok.eos_token_ids else mcfg.eos_token_ids
    engine = Engine(
        runner,
        Scheduler(kv, eng.max_num_seqs, eng.max_num_batched_tokens),
        tok,
        eos,
        max_len,
        metrics,
        eng.speculative_tokens,
    )
    return engine, tok, max_len


def _without_mtp_layer(eng: EngineSection, mcfg, mtp) -> EngineSection:
    """The budget left for the main model's layers once the MTP block's cache layer (as many blocks)
    has its share."""
    if not eng.speculative_tokens or mtp is None:
        return eng
    main, extra = (
        math.prod(shape) for shape in (mcfg.kv_cache_shape(1, eng.block_size), mtp.kv_cache_shape(1, eng.block_size))
    )
    return dataclasses.replace(eng, kv_cache_bytes=eng.kv_cache_bytes * main // (main + extra))
