"""The cluster as the nodes see it: a node's HTTP port from the command line, model path, a printable summary."""

from __future__ import annotations

import dataclasses
import os

from afd.config.placement import Placement, format_experts
from afd.config.schema import ClusterConfig, Node


def resolve_model_path(path: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """The checkpoint directory `model.path` names: `demo` is the built-in demo checkpoint, made into the
    cache on first use; a directory is itself; anything else is a Hugging Face hub name (afd.model.hub)."""
    if path == "demo":
        from afd.model.demo import ensure_demo_checkpoint

        return ensure_demo_checkpoint()
    from afd.model.hub import checkpoint_dir

    return checkpoint_dir(path, revision, download_dir)


def model_dir(cfg: ClusterConfig, download: bool = True) -> str:
    """resolve_model_path of the config's model section (download False: a hub name only from the cache)."""
    if cfg.model.path != "demo" and not download:
        from afd.model.hub import checkpoint_dir

        return checkpoint_dir(cfg.model.path, cfg.model.revision, cfg.model.download_dir, download=False)
    return resolve_model_path(cfg.model.path, cfg.model.revision, cfg.model.download_dir)


def local_model(cfg: ClusterConfig):
    """(cfg with its dtype resolved, the model's config) where this host reads the checkpoint without a
    download (the demo's always), else (cfg, None): what the offline reports (check-config, rebalance) need."""
    from afd.model.config import ConfigError
    from afd.model.demo_config import DEMO_CONFIG
    from afd.model.registry import config_from_hf, load_config

    if cfg.model.path == "demo":
        return with_model_defaults(cfg), config_from_hf(DEMO_CONFIG)
    try:
        path = model_dir(cfg, download=False)
    except ConfigError:
        return cfg, None
    if not os.path.isfile(os.path.join(path, "config.json")):
        return cfg, None
    return with_model_defaults(cfg), load_config(path)


def with_model_defaults(cfg: ClusterConfig) -> ClusterConfig:
    """`cfg` with what it leaves to the checkpoint settled from its config.json: model.dtype `auto` (vLLM's
    default) made the checkpoint's own dtype, and layout.routing, where unset, made `attention` for a family
    whose router reads the token ids (DeepSeek-V4's hash layers; afd.config.loader.check_routing). Every
    process reads the same config.json, so every node of a cluster settles on the same values."""
    from afd.model.config import AUTO_DTYPE, checkpoint_dtype, read_config_json

    auto_dtype, auto_routing = cfg.model.dtype == AUTO_DTYPE, cfg.layout.routing is None and not cfg.colocated
    if not (auto_dtype or auto_routing):
        return cfg
    if cfg.model.path == "demo":
        from afd.model.demo_config import DEMO_CONFIG

        d = DEMO_CONFIG
    else:
        d = read_config_json(model_dir(cfg))
    if auto_dtype:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=checkpoint_dtype(d)))
    if auto_routing:
        from afd.model.registry import config_from_hf

        if config_from_hf(d).routes_by_token_ids:
            cfg = dataclasses.replace(cfg, layout=dataclasses.replace(cfg.layout, routing="attention"))
    return cfg


def cpu_threads(cfg: ClusterConfig, name: str) -> int:
    """Intra-op threads for a node: its YAML value, or its host's usable CPUs split among the CPU nodes
    there (two nodes that each take every core fight over them, and the exchange stops being hidden).
    Usable, not os.cpu_count(): in a pod with a CPU limit the host's core count oversubscribes the quota."""
    from afd.cluster.cpus import usable_cpus

    node = cfg.node(name)
    if node.threads:
        return node.threads
    if node.device_type != "cpu":
        return 0
    sharing = sum(1 for p in cfg.processes if p.node.host == node.host and p.node.device_type == "cpu")
    return max(1, usable_cpus() // sharing)


def served_model_name(model_path: str, override: str | None = None) -> str:
    """The model's name in the API and in every node's metrics labels: `model.served_model_name`
    (`--served-model-name`), else the model path as given, as vLLM names it (`demo` for the demo: what a
    client that followed `afd serve demo` sends)."""
    return override or model_path


def with_http_port(cfg: ClusterConfig, http_port: int | None, node: str | None = None) -> ClusterConfig:
    """`cfg` with node `node`'s HTTP port (default: the first attention node's) set to `http_port`."""
    if http_port is None:
        return cfg
    target = node or cfg.attention_nodes[0].name

    def patch(n: Node) -> Node:
        if n.name != target:
            return n
        return dataclasses.replace(n, ports=dataclasses.replace(n.ports, http=http_port))

    return dataclasses.replace(cfg, nodes=tuple(patch(n) for n in cfg.nodes))


def _model_type(path: str) -> str | None:
    """config.json's model_type (the model family), when the checkpoint is readable here."""
    from afd.model.config import ConfigError, read_config_json
    from afd.model.demo_config import DEMO_CONFIG

    if path == "demo":
        return str(DEMO_CONFIG["model_type"])
    from afd.model.hub import checkpoint_dir

    try:
        model_type = read_config_json(checkpoint_dir(path, download=False)).get("model_type")
        return model_type if isinstance(model_type, str) else None
    except ConfigError:
        return None


def describe(cfg: ClusterConfig, placement: Placement | None) -> str:
    coord = cfg.coordinator
    lines = [
        f"cluster {cfg.cluster.name}: {cfg.topology_name}, model {cfg.model.path} ({cfg.model.dtype})",
        f"coordinator: {coord.name} at {coord.host}:{coord.ports.control}; data-plane rendezvous "
        f"{cfg.attention_nodes[0].host}:{cfg.attention_nodes[0].ports.control} (rank 0's control port)",
        f"overlap: {'on' if cfg.layout.overlap else 'off'}, micro-batches: {cfg.layout.micro_batches or 'auto'}",
    ]
    family = _model_type(cfg.model.path)
    if family:
        lines.insert(1, f"family: {family}")
    if cfg.colocated:
        lines.append("no FFN nodes: every attention node runs the experts itself")
    for p in cfg.processes:
        n = p.node
        if p.tp_rank:  # listens on nothing of its own
            lines.append(
                f"  rank {cfg.rank(p.name)}: {p.name:<10} {n.role:<9} {p.device:<6} {n.host} TP rank "
                f"{p.tp_rank} of {n.name}"
            )
            continue
        line = f"  rank {cfg.rank(n.name)}: {n.name:<10} {n.role:<9} {p.device:<6} {n.host} control {n.ports.control}"
        if n.role == "attention":
            line += f", API {cfg.http.scheme}://{n.host}:{n.ports.http}"
        else:
            if n.ports.metrics:
                line += f", metrics http://{n.host}:{n.ports.metrics}/metrics"
            if placement is not None:
                line += f", experts {format_experts(placement.held_by(n.name))}"
                line += " + identity experts" if cfg.serves_zero(n.name) else ""
        lines.append(line)
    return "\n".join(lines)
