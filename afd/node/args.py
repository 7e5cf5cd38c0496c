"""Command-line flags and start-up shared by the node commands (`--config FILE --node NAME`).

Values given on the command line override the YAML, which overrides the defaults.
"""

from __future__ import annotations

import argparse
import logging

from afd.cluster.overrides import add_graph_mode_arg, add_speculative_arg, positive_int


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--config", default=None, help="cluster YAML")
    g.add_argument("--node", default=None, help="this node's name in the cluster YAML")
    g.add_argument(
        "--bind-host",
        default=None,
        help="address the node's servers listen on (default: the node's host in the YAML; "
        "0.0.0.0 in a container whose YAML host is a service name)",
    )
    g.add_argument("--served-model-name", default=None, help="model name in the API and metrics")
    add_speculative_arg(g)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The attention node's overrides that vLLM users know by these names."""
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="context limit of a request (default: the YAML's, else the model's)",
    )
    p.add_argument("--max-num-seqs", type=positive_int, default=None, help="sequences per step (default: the YAML's)")
    p.add_argument(
        "--chat-template", default=None, help="a Jinja chat template, or a file holding one (default: the tokenizer's)"
    )
    p.add_argument(
        "--seed", type=int, default=None, help="seed of the random sampling of requests that bring no seed of their own"
    )
    add_graph_mode_arg(p)


def load_cluster_args(args, role: str):
    """The cluster YAML with this command's overrides; checks that --node names a node of `role`."""
    from afd.cluster.config import ClusterConfigError, load
    from afd.cluster.topology import with_overrides

    if not args.node:
        raise ClusterConfigError(f"{args.config}: --node is required with --config")
    cfg = load(args.config)
    node = cfg.node(args.node)
    if node.role != role:
        raise ClusterConfigError(f"{args.config}: node {args.node!r} is an {node.role} node, not {role}")
    return with_overrides(
        cfg,
        model=args.model,
        dtype=args.dtype,
        node=args.node,
        http_port=getattr(args, "port", None),
        max_model_len=getattr(args, "max_model_len", None),
        max_num_seqs=getattr(args, "max_num_seqs", None),
        shutdown_timeout=getattr(args, "shutdown_timeout", None),
        speculative_tokens=getattr(args, "speculative_tokens", None),
        graph_mode=getattr(args, "graph_mode", None),
    )


def setup_logging(role: str, name) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role}[{name}] %(levelname)s %(message)s")


def start_cluster_node(args, role: str):
    """The common start of `afd-attention/afd-ffn --config FILE --node NAME`: the YAML with this command's
    overrides, logging, torch threads. Returns the config, or an exit code (2) after printing why."""
    import sys

    from afd.cluster.config import ClusterConfigError

    prog = "afd-attention" if role == "attention" else "afd-ffn"
    try:
        cfg = load_cluster_args(args, role)
        err = _insecure_start(cfg, args.node)
    except ClusterConfigError as e:
        err = str(e)
    if err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    if args.bind_host is None:  # nothing listens beyond the address the cluster file gives the node
        args.bind_host = cfg.node(args.node).host
    rank = getattr(args, "tp_rank", 0)
    setup_logging(role, f"{args.node}.tp{rank}" if rank else args.node)
    import torch

    from afd.cluster.cpus import usable_cpus
    from afd.cluster.topology import cpu_threads

    # Device nodes keep torch's default, which counts the host's cores: cap it at what a pod's CPU limit
    # allows, or its host-side ops are throttled by the quota.
    threads = args.threads or cpu_threads(cfg, args.node) or min(torch.get_num_threads(), usable_cpus())
    torch.set_num_threads(threads)
    return cfg


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a DNS name: reachable from elsewhere
        return False


def _insecure_start(cfg, name: str) -> str | None:
    """Why this node must not start: a host others can reach, no cluster token, and no explicit
    `cluster.insecure: true`."""
    from afd.cluster.token import TOKEN_ENV, cluster_token

    node = cfg.node(name)
    if _is_loopback(node.host) or cluster_token() or cfg.cluster.insecure:
        return None
    return (
        f"{cfg.source}: node {name} is on {node.host}, which other hosts can reach, and {TOKEN_ENV} is not "
        f"set: anyone reaching its control port could shut the cluster down. Set {TOKEN_ENV} to the same "
        "secret on every node, or `cluster.insecure: true` in the YAML to run without one."
    )
