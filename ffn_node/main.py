"""`afd-ffn`: one FFN node process.

    afd-ffn --config cluster.yaml --node ffn0      # a node of a cluster YAML (the control plane)
    afd-ffn --model PATH --rank R --world-size W --master-port P --peer-ranks 0,1   # data plane only
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from afd.node_args import add_cluster_args, add_dataplane_args, add_model_args, parse_ranks, setup_logging
from afd.signals import exit_on_signal

log = logging.getLogger("afd.ffn")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="afd-ffn", description="FFN node: serves the MoE half of every layer")
    add_cluster_args(p)
    add_model_args(p, required=False)
    add_dataplane_args(p, required=False)
    p.add_argument("--expert-range", default=None, help="LO:HI routed experts this node holds (default: all)")
    p.add_argument("--no-zero-experts", action="store_true", help="another FFN node applies identity experts")
    p.add_argument("--report-file", default=None, help="write steps, tokens and compute/idle seconds here")
    return p


def main(argv: list[str] | None = None) -> int:
    exit_on_signal()  # first: torch and grpc start threads at import, and threads inherit the mask
    args = build_parser().parse_args(argv)
    if args.config:
        from ffn_node.cluster_mode import run_cluster_node

        return run_cluster_node(args)
    missing = [f for f in ("model", "rank", "world_size", "master_port", "peer_ranks") if getattr(args, f) is None]
    if missing:
        print(f"afd-ffn: error: give --config and --node, or the data-plane flags (missing: "
              f"{', '.join('--' + m.replace('_', '-') for m in missing)})", file=sys.stderr)
        return 2
    return _run_explicit(args)


def _run_explicit(args) -> int:
    setup_logging("ffn", args.rank)
    import torch

    from afd.backend import get_backend
    from afd.checkpoint import build_ffn_half, open_reader
    from afd.config import ModelConfig
    from afd.llm import parse_dtype
    from afd.transport import DataPlane, PeerError
    from ffn_node.server import FFNServer

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = ModelConfig.from_dir(args.model)
    lo, hi = 0, cfg.n_routed_experts
    if args.expert_range:
        try:
            lo, hi = (int(v) for v in args.expert_range.split(":"))
        except ValueError:
            log.error("--expert-range: expected LO:HI, got %r", args.expert_range)
            return 2
    backend = get_backend(args.device, args.device_index)
    dtype = parse_dtype(args.dtype or "float32")
    ffn = build_ffn_half(cfg, open_reader(args.model, args.dummy_weights, args.seed), dtype, backend.device,
                         lo, hi, serves_zero=not args.no_zero_experts)
    log.info("experts [%d, %d) of %d loaded%s", lo, hi, cfg.n_routed_experts,
             "" if args.no_zero_experts else ", serving identity experts")
    plane = DataPlane(backend, args.rank, args.world_size, args.master_addr, args.master_port,
                      args.comm_timeout)
    server = FFNServer(ffn, backend, plane, parse_ranks(args.peer_ranks), dtype)
    try:
        reason = server.serve()
    except PeerError as e:
        log.error("stopping: %s", e)
        plane.close()
        return 1
    t = server.timers
    if args.report_file:
        with open(args.report_file, "w") as f:
            json.dump({"steps": server.steps, "tokens": server.tokens, "compute_seconds": t.total("compute"),
                       "idle_seconds": t.total("idle")}, f)
    log.info("stopped (%s) after %d steps, %d tokens; compute %.3fs, idle %.3fs", reason, server.steps,
             server.tokens, t.total("compute"), t.total("idle"))
    plane.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
