"""The cluster as the nodes see it: a node's HTTP port from the command line, model path, a printable summary."""

from __future__ import annotations

import dataclasses

from afd.cluster.config import ClusterConfig, Node
from afd.cluster.placement import Placement, format_experts


def resolve_model_path(path: str) -> str:
    """`demo` is the built-in demo checkpoint, made into the cache on first use."""
    if path == "demo":
        from afd.model.demo import ensure_demo_checkpoint

        return ensure_demo_checkpoint()
    return path


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
    (`--served-model-name`), else the model path as given (the demo's own name for `demo`)."""
    if override:
        return override
    return "demo-longcat-flash" if model_path == "demo" else model_path


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
        return DEMO_CONFIG["model_type"]
    try:
        return read_config_json(path).get("model_type")
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
