"""A serving attention node's state over its loaded rank: metrics, tokenizer, the engine (afd.engine.factory)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from afd.cluster.topology import served_model_name
from afd.config.schema import ClusterConfig
from afd.control import control_pb2 as pb
from afd.engine.factory import build_engine
from afd.engine.membership import PlaneMembership
from afd.engine.tokenizer import Tokenizer, load_tokenizer
from afd.observability.attention_metrics import AttentionMetrics
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
    cfg, args, rt = node.cfg, node.args, node.rt
    name = served_model_name(cfg.model.path, cfg.model.served_model_name)
    metrics = AttentionMetrics(args.node, name)
    metrics.watch_cluster_state(lambda: rt.cluster_state)
    metrics.watch_tp(node.tp)
    tok = serving_tokenizer(cfg, rt.model_path)
    engine = build_engine(
        cfg,
        node.half,
        node.live_moe,
        rt.backend.device,
        tp=node.tp,
        mtp=node.loaded.mtp,
        backend=rt.backend,
        metrics=metrics,
        tokenizer=tok,
    )
    engine.membership = PlaneMembership(
        node.reform if cfg.cluster.rejoin_timeout > 0 else None, rt.release_plane, node.adopt
    )
    return ServerState(
        engine,
        tok,
        name,
        rt.model_path,
        Limits(engine.max_model_len, rt.model_cfg.vocab_size),
        metrics,
        ready=lambda: rt.cluster_state in _SERVING,
        api_key=args.api_key,
        max_body_bytes=cfg.http.max_body_bytes,
        max_grammar_bytes=cfg.http.max_grammar_bytes,
        log_requests=cfg.engine.enable_log_requests,
    )


def serving_tokenizer(cfg: ClusterConfig, model_path: str) -> Tokenizer | None:
    """The tokenizer a serving node answers with (`model.chat_template` over the checkpoint's), and torch's
    default generator seeded by `engine.sampling_seed` for requests that bring no seed of their own."""
    tok = load_tokenizer(model_path)
    if cfg.model.chat_template:
        if tok is None:
            raise ValueError(f"--chat-template: {model_path} has no tokenizer.json to render a template for")
        tok.set_chat_template(cfg.model.chat_template)
    if cfg.engine.sampling_seed is not None:
        torch.manual_seed(cfg.engine.sampling_seed)
    return tok
