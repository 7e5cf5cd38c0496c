"""Command-line flags shared by the node commands and the local launcher.

A node runs either from a cluster YAML (`--config FILE --node NAME`, the control plane hands out ranks)
or from explicit data-plane flags (what `afd generate` uses for its short-lived local processes).
Values given on the command line override the YAML, which overrides the defaults.
"""

from __future__ import annotations

import argparse
import logging


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--config", default=None, help="cluster YAML")
    g.add_argument("--node", default=None, help="this node's name in the cluster YAML")
    g.add_argument("--bind-host", default="0.0.0.0", help="address the node's servers listen on")
    g.add_argument("--served-model-name", default=None, help="model name in the API and metrics")


def add_model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", required=required, default=None, help="HF checkpoint directory")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default float32")
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda", "npu"])
    g.add_argument("--device-index", type=int, default=0)
    g.add_argument("--dummy-weights", action="store_true", help="seeded random weights; config.json only")
    g.add_argument("--seed", type=int, default=0, help="seed of --dummy-weights")
    g.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")


def add_dataplane_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    g = p.add_argument_group("data plane (without --config)")
    g.add_argument("--rank", type=int, required=required)
    g.add_argument("--world-size", type=int, required=required)
    g.add_argument("--master-addr", default="127.0.0.1")
    g.add_argument("--master-port", type=int, required=required)
    g.add_argument("--peer-ranks", required=required, help="comma-separated data-plane ranks of the other role")
    g.add_argument("--comm-timeout", type=float, default=60.0, help="seconds any data-plane wait may take")


def parse_ranks(s: str) -> list[int]:
    try:
        ranks = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--peer-ranks: expected comma-separated integers, got {s!r}") from None
    if not ranks:
        raise SystemExit("--peer-ranks: no ranks given")
    return ranks


def load_cluster_args(args, role: str):
    """The cluster YAML with this command's overrides; checks that --node names a node of `role`."""
    from afd.cluster_config import ClusterConfigError, load
    from afd.topology import with_overrides

    if not args.node:
        raise ClusterConfigError(f"{args.config}: --node is required with --config")
    cfg = load(args.config)
    node = cfg.node(args.node)
    if node.role != role:
        raise ClusterConfigError(f"{args.config}: node {args.node!r} is an {node.role} node, not {role}")
    cfg = with_overrides(cfg, model=args.model, dtype=args.dtype, node=args.node,
                         http_port=getattr(args, "port", None))
    timeout = getattr(args, "shutdown_timeout", None)
    if timeout is not None:
        import dataclasses

        cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, shutdown_timeout=timeout))
    return cfg


def setup_logging(role: str, name) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role}[{name}] %(levelname)s %(message)s")


def start_cluster_node(args, role: str):
    """The common start of `afd-attention/afd-ffn --config FILE --node NAME`: the YAML with this command's
    overrides, logging, torch threads. Returns the config, or an exit code (2) after printing why."""
    import sys

    from afd.cluster_config import ClusterConfigError

    try:
        cfg = load_cluster_args(args, role)
    except ClusterConfigError as e:
        prog = "afd-attention" if role == "attention" else "afd-ffn"
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    setup_logging(role, args.node)
    import torch

    from afd.topology import cpu_threads

    threads = args.threads or cpu_threads(cfg, args.node)
    if threads:
        torch.set_num_threads(threads)
    return cfg
