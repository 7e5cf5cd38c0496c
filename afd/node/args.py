"""Command-line flags and start-up shared by the node commands (`--config FILE --node NAME`).

Values given on the command line override the YAML, which overrides the defaults.
"""

from __future__ import annotations

import argparse
import logging

from afd.cluster.token import api_key
from afd.config.flags import add_config_flags, add_flags
from afd.config.schema import ClusterConfig
from afd.errors import UserError


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """A node command's flags: its place in the cluster YAML, and every config flag over the YAML."""
    g = p.add_argument_group("cluster")
    add_flags(g, "config", "node", "bind_host", "threads")
    add_config_flags(p)


def load_cluster_args(args, role: str):
    """The cluster YAML with this command's overrides; checks that --node names a node of `role`."""
    from afd.cluster.topology import with_http_port
    from afd.config.flags import overrides_of, with_overrides
    from afd.config.loader import load
    from afd.config.schema import ClusterConfigError

    if not args.node:
        raise ClusterConfigError(f"{args.config}: --node is required with --config")
    cfg = load(args.config)
    node = cfg.node(args.node)
    if node.role != role:
        raise ClusterConfigError(f"{args.config}: node {args.node!r} is an {node.role} node, not {role}")
    if hasattr(args, "api_key"):  # resolved once: the file read, the warning given
        args.api_key, args.api_key_file = api_key(args), None
    return with_http_port(with_overrides(cfg, overrides_of(args)), getattr(args, "port", None), args.node)


def setup_logging(role: str, name) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role}[{name}] %(levelname)s %(message)s")


def start_cluster_node(args, role: str) -> ClusterConfig:
    """The common start of `afd-attention/afd-ffn --config FILE --node NAME`: the YAML with this command's
    overrides, logging, torch threads. A mistake (the YAML, the node's device, a port taken) raises
    UserError, which the command prints as one line and exits 2 for."""
    try:
        from afd.cluster.topology import with_model_defaults

        cfg = with_model_defaults(load_cluster_args(args, role))
        err = _insecure_start(cfg, args.node) or _device_missing(cfg, args.node, getattr(args, "tp_rank", 0) or 0)
    except ValueError as e:  # ClusterConfigError, or an unreadable --api-key-file
        raise UserError(str(e)) from None
    if err:
        raise UserError(err)
    if args.bind_host is None:  # nothing listens beyond the address the cluster file gives the node
        args.bind_host = cfg.node(args.node).host
    rank = getattr(args, "tp_rank", 0)
    from afd.cluster.ports import PortInUse, check_listeners

    try:  # before registering or loading anything; the servers bind these moments later
        api = hasattr(args, "port")  # the serving command; `generate` opens no API
        check_listeners(cfg, args.node, rank or 0, args.bind_host, getattr(args, "host", None), api)
    except PortInUse as e:
        raise UserError(str(e)) from None
    setup_logging(role, f"{args.node}.tp{rank}" if rank else args.node)
    import torch

    from afd.cluster.cpus import usable_cpus
    from afd.cluster.topology import cpu_threads

    # Device nodes keep torch's default, which counts the host's cores: cap it at what a pod's CPU limit
    # allows, or its host-side ops are throttled by the quota.
    threads = args.threads or cpu_threads(cfg, args.node) or min(torch.get_num_threads(), usable_cpus())
    torch.set_num_threads(threads)
    return cfg


def _device_missing(cfg, name: str, tp_rank: int) -> str | None:
    """Why this process's device is not here (`device cuda:5: this machine has 2 CUDA devices (cuda:0-1)`),
    said before anything starts; a TP rank the node does not have is left to its own check."""
    from afd.backend import DeviceUnavailable, check_device

    if not 0 <= tp_rank < cfg.layout.attention_tp:
        return None
    try:
        check_device(cfg.node(name).rank_device(tp_rank))
    except DeviceUnavailable as e:
        return f"{cfg.source}: node {name}{f' TP rank {tp_rank}' if tp_rank else ''}: {e}"
    return None


def _insecure_start(cfg, name: str) -> str | None:
    """Why this node must not start: a host others can reach, no cluster token, and no explicit
    `cluster.insecure: true`."""
    from afd.cluster.host import is_loopback
    from afd.cluster.token import TOKEN_ENV, TOKEN_FILE_ENV, cluster_token

    node = cfg.node(name)
    token = cluster_token()  # read here: an unreadable AFD_CLUSTER_TOKEN_FILE is one line, before bring-up
    if is_loopback(node.host) or token or cfg.cluster.insecure:
        return None
    return (
        f"{cfg.source}: node {name} is on {node.host}, which other hosts can reach, and {TOKEN_ENV} is not "
        f"set: anyone reaching its control port could shut the cluster down. Set {TOKEN_ENV} (or "
        f"{TOKEN_FILE_ENV}, a 0600 file holding it) to the same secret on every node, or "
        "`cluster.insecure: true` in the YAML to run without one."
    )
