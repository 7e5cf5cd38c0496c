"""`afd-attention colocated`: both halves of the model in this one process, behind the same HTTP API.

What `afd serve MODEL --colocated` runs: the reference path and the smallest deployment. No control or
data plane; the MoE half is called in-process (afd.dataplane.exchange.LocalMoE).
"""

from __future__ import annotations

import argparse
import logging
import sys

from afd.cluster.token import api_key
from afd.config.flags import DefaultsHelpFormatter, add_config_flags, add_flags
from afd.node.args import setup_logging
from afd.node.signals import set_stop_handler

log = logging.getLogger("afd.attention")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="afd-attention colocated",
        formatter_class=DefaultsHelpFormatter,
        description="both halves of the model in one process, behind the OpenAI API",
    )
    add_flags(p, "device", "host", "port", "api_key", "threads")
    add_config_flags(p)
    return p


def config_of(args):
    """The configuration of a colocated server: one attention node and no FFN nodes, the flags over the
    defaults (one micro-batch unless told: with the experts in process there is no exchange to hide)."""
    from afd.cluster.local_config import local_config
    from afd.config.flags import overrides_of

    sections = overrides_of(args)
    sections["layout"] = {"micro_batches": 1, **sections.get("layout", {})}
    host = args.host or "127.0.0.1"
    return local_config(1, 0, sections, name="colocated", http_port=args.port or 8000, host=host)


def run(args) -> int:
    import torch

    from afd.backend import get_backend
    from afd.cluster.topology import model_dir, served_model_name, with_model_defaults
    from afd.dataplane.exchange import LocalMoE
    from afd.engine.factory import build_engine
    from afd.engine.load import Halves
    from afd.model.registry import load_config
    from afd.observability.attention_metrics import AttentionMetrics
    from attention_node.api_server import ServerState, build_app
    from attention_node.http_server import api_listen, api_server, api_socket, check_tls, serve_on
    from attention_node.openai_protocol import Limits
    from attention_node.setup import serving_tokenizer

    if not args.model:
        print("afd-attention colocated: error: --model is required", file=sys.stderr)
        return 2
    setup_logging("colocated", "0")
    try:  # before the model loads: a bad value, a port in use or a bad certificate is one line
        cfg, key = config_of(args), api_key(args)
        host, port = cfg.attention_nodes[0].host, cfg.attention_nodes[0].ports.http
        check_tls(cfg.http)
        what = "the colocated server's --port"
        sock = api_socket(host, port, what)
    except (OSError, ValueError) as e:
        print(f"afd-attention colocated: error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        path = model_dir(cfg)
        cfg = with_model_defaults(cfg)
    except ValueError as e:  # ConfigError: a hub name not found, an unreadable config.json
        print(f"afd-attention colocated: error: {e}", file=sys.stderr)
        return 2
    mcfg, backend = load_config(path), get_backend(args.device)
    halves = Halves.load(cfg, path, mcfg, backend)
    name = served_model_name(cfg.model.path, cfg.model.served_model_name)
    metrics = AttentionMetrics("colocated", name)
    st: ServerState  # made below, once the engine is
    metrics.watch_cluster_state(lambda: 3 if st.draining else 1)  # a cluster of one: READY (1), DRAINING (3)
    tok = serving_tokenizer(cfg, path)
    assert halves.ffn is not None  # Halves.load loads every expert where the cluster has no FFN nodes
    moe = LocalMoE(halves.ffn, backend)
    engine = build_engine(
        cfg, halves.attn, moe, backend.device, mtp=halves.mtp, backend=backend, metrics=metrics, tokenizer=tok
    )
    st = ServerState(
        engine,
        tok,
        name,
        path,
        Limits(engine.max_model_len, mcfg.vocab_size),
        metrics,
        ready=lambda: True,
        api_key=key,
        max_body_bytes=cfg.http.max_body_bytes,
        max_grammar_bytes=cfg.http.max_grammar_bytes,
        log_requests=cfg.engine.enable_log_requests,
    )
    server = api_server(build_app(st), cfg.http, sock)
    try:
        api_listen(sock, what)
    except OSError as e:
        print(f"afd-attention colocated: error: {e}", file=sys.stderr)
        return 2

    def stop(_) -> None:
        st.draining = True
        engine.stop(timeout=5)

    set_stop_handler(stop)
    engine.start()
    log.info("API ready at %s://%s:%d (colocated, %s on %s)", cfg.http.scheme, host, port, name, backend.device)
    serve_on(server, sock)
    return 0
