"""`afd-attention colocated`: both halves of the model in this one process, behind the same HTTP API.

What `afd serve MODEL --colocated` runs: the reference path and the smallest deployment. No control or
data plane; the MoE half is called in-process (afd.dataplane.exchange.LocalMoE).
"""

from __future__ import annotations

import argparse
import logging
import os

from afd.cluster.config import EngineSection
from afd.cluster.overrides import (
    DefaultsHelpFormatter,
    add_speculative_arg,
    parse_bytes_arg,
    positive_int,
)
from afd.node.args import add_engine_args, setup_logging
from afd.node.signals import set_stop_handler

log = logging.getLogger("afd.attention")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="afd-attention colocated",
        formatter_class=DefaultsHelpFormatter,
        description="both halves of the model in one process, behind the OpenAI API",
    )
    p.add_argument("--model", required=True, help="HF checkpoint directory, or `demo`")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda", "npu", "auto"],
        help="auto: npu if torch_npu sees one, else cuda if torch sees one, else cpu",
    )
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP API listens on")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("AFD_API_KEY"), help="require Bearer KEY on /v1 routes")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: the model path)")
    p.add_argument("--dummy-weights", action="store_true", help="seeded random weights; config.json only")
    p.add_argument("--kv-cache-bytes", type=parse_bytes_arg, default=256 << 20, help="KV cache budget, e.g. 1GiB")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    add_engine_args(p)
    add_speculative_arg(p)
    return p


def run(args) -> int:
    import torch
    import uvicorn

    from afd.backend import get_backend
    from afd.cluster.topology import resolve_model_path, served_model_name
    from afd.dataplane.exchange import LocalMoE
    from afd.engine.graph import GraphSettings
    from afd.model.checkpoint import build_attention_half, build_ffn_half, build_mtp_layer, open_reader
    from afd.model.config import parse_dtype
    from afd.model.registry import load_config
    from afd.observability.metrics import AttentionMetrics
    from attention_node.api_server import ServerState, build_app
    from attention_node.cluster_mode import UvicornServer
    from attention_node.openai_protocol import Limits
    from attention_node.setup import build_engine

    setup_logging("colocated", "0")
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    mcfg, dtype, backend = load_config(path), parse_dtype(args.dtype), get_backend(args.device)
    reader = open_reader(path, args.dummy_weights, 0)
    attn = build_attention_half(mcfg, reader, dtype, backend.device)
    spec = args.speculative_tokens or 0
    ffn = build_ffn_half(mcfg, reader, dtype, backend.device, mtp=spec > 0)
    mtp = build_mtp_layer(mcfg, reader, dtype, backend.device) if spec else None
    name = served_model_name(args.model, args.served_model_name)
    metrics = AttentionMetrics("colocated", name)
    metrics.watch_cluster_state(lambda: 3 if st.draining else 1)  # a cluster of one: READY (1), DRAINING (3)
    eng = EngineSection(
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_bytes,
        speculative_tokens=spec,
        **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}),
    )
    engine, tok, max_len = build_engine(
        attn,
        LocalMoE(ffn, backend),
        path,
        mcfg,
        dtype,
        backend.device,
        eng,
        args.max_model_len,
        args,
        metrics,
        mtp=mtp,
        graph=GraphSettings(args.graph_mode),
        backend=backend,
    )
    st = ServerState(
        engine, tok, name, path, Limits(max_len, mcfg.vocab_size), metrics, ready=lambda: True, api_key=args.api_key
    )
    server = UvicornServer(
        uvicorn.Config(
            build_app(st),
            host=args.host,
            port=args.port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
        )
    )

    def stop(_) -> None:
        st.draining = True
        engine.stop(timeout=5)

    set_stop_handler(stop)
    engine.start()
    log.info("API ready at http://%s:%d (colocated, %s on %s)", args.host, args.port, name, backend.device)
    server.run()
    return 0
