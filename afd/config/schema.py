"""The cluster YAML's shape: small frozen dataclasses, one per section, each field documented.

This is afd's one configuration. afd.config.loader loads and checks a YAML into it and writes it back
(`to_dict`); a field declared with `opt(default, "--flag")` is also that command-line option in every
command that takes it, its docstring the option's help (afd.config.flags generates them), and a keyword
of `afd.LLM(model, **overrides)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from afd.config.http_section import HttpSection
from afd.config.placement import Placement, default_placement, from_yaml
from afd.config.sections import (
    SECTION_KEYS,
    ClusterSection,
    EngineSection,
    Layout,
    ModelSection,
    PrefetchSection,
)


class ClusterConfigError(ValueError):
    """The cluster YAML is malformed; the message starts with the file and key path."""


@dataclass(frozen=True)
class Ports:
    control: int
    """gRPC: the node's health service and the data plane's rendezvous store (and the coordinator, on the
    coordinator node)."""
    data: int
    """Reserved: the data-plane rendezvous moved to the control port (behind the cluster token); nothing
    listens here."""
    http: int | None = None
    """OpenAI API, /health, /metrics (attention nodes)."""
    metrics: int | None = None
    """/health and /metrics of FFN nodes."""


@dataclass(frozen=True)
class Node:
    name: str
    role: str
    host: str
    ports: Ports
    device: str = "cpu"
    """cpu, cuda, cuda:N, npu or npu:N (no N: 0). One node per accelerator on a host: two nodes with the same
    host and device are refused (NCCL and HCCL drive a device from one process); CPU nodes share freely."""
    threads: int | None = None
    """torch intra-op threads; default on CPU: this host's usable CPUs (affinity and cgroup limit) shared
    evenly by its CPU nodes."""

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def device_index(self) -> int:
        return int(self.device.split(":")[1]) if ":" in self.device else 0

    def rank_device(self, tp_rank: int) -> str:
        """TP rank r's device: the node's device index + r (cpu for every rank of a CPU node)."""
        return self.device if self.device_type == "cpu" else f"{self.device_type}:{self.device_index + tp_rank}"


@dataclass(frozen=True)
class Process:
    """One process of the cluster: a node, or one TP rank of an attention node."""

    name: str
    """The node's name for its TP rank 0 (and every FFN node); `NODE.tpR` for rank R > 0."""
    node: Node
    tp_rank: int = 0

    @property
    def device(self) -> str:
        return self.node.rank_device(self.tp_rank)


def process_name(node: str, tp_rank: int) -> str:
    return node if tp_rank == 0 else f"{node}.tp{tp_rank}"


@dataclass(frozen=True)
class ClusterConfig:
    cluster: ClusterSection
    model: ModelSection
    layout: Layout
    engine: EngineSection
    nodes: tuple[Node, ...]
    prefetch: PrefetchSection = PrefetchSection()
    source: str = "<dict>"
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)
    """The key paths the YAML spelled out (`engine.block_size`, `nodes.0.device`): `to_dict` writes them back
    even when they hold the default, so a file round-trips unchanged."""
    http: HttpSection = HttpSection()

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise ClusterConfigError(f"{self.source}: no node named {name!r} (nodes: {', '.join(self.names)})")

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    @property
    def attention_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.role == "attention"]

    @property
    def ffn_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.role == "ffn"]

    @property
    def coordinator(self) -> Node:
        return self.node(self.cluster.coordinator or self.attention_nodes[0].name)

    @property
    def processes(self) -> list[Process]:
        """In data-plane rank order: every attention node's TP ranks, then the FFN nodes, in file order."""
        tp = self.layout.attention_tp
        return [Process(process_name(n.name, r), n, r) for n in self.attention_nodes for r in range(tp)] + [
            Process(n.name, n) for n in self.ffn_nodes
        ]

    @property
    def process_names(self) -> list[str]:
        return [p.name for p in self.processes]

    def process(self, name: str) -> Process:
        for p in self.processes:
            if p.name == name:
                return p
        raise ClusterConfigError(
            f"{self.source}: no node or TP rank named {name!r} (processes: {', '.join(self.process_names)})"
        )

    def shares_device(self, node: str) -> bool:
        """A process of `node` runs on the device of another node's process (cluster.share_devices)."""

        def where(p: Process) -> tuple[str, str, int]:
            return p.node.host, p.node.device_type, p.node.device_index + p.tp_rank

        mine = {where(p) for p in self.processes if p.node.name == node and p.node.device_type != "cpu"}
        return any(where(p) in mine for p in self.processes if p.node.name != node)

    def rank(self, name: str) -> int:
        """Data-plane rank of a process (a node's name: its TP rank 0)."""
        return self.process_names.index(name)

    def tp_ranks(self, node: str) -> list[int]:
        """The data-plane ranks of an attention node's TP group, in TP-rank order."""
        first = self.rank(node)
        return list(range(first, first + self.layout.attention_tp))

    @property
    def colocated(self) -> bool:
        """No FFN nodes: every attention node runs the experts itself."""
        return not self.ffn_nodes

    @property
    def routing(self) -> str:
        """layout.routing, resolved: attention by default with more than one FFN node."""
        if self.layout.routing is not None:
            return self.layout.routing
        return "attention" if len(self.ffn_nodes) > 1 else "ffn"

    def placement(self, n_routed: int, groups: int = 1) -> Placement:
        """Which experts each FFN node holds (layout.placement, or the default split); `groups`: the
        router's expert groups (ModelConfig.expert_groups), which the default cuts at."""
        ffn = [n.name for n in self.ffn_nodes]
        if self.layout.placement:
            return from_yaml(self.layout.placement, n_routed, ffn)
        return default_placement(n_routed, ffn, groups)

    def serves_zero(self, name: str) -> bool:
        """Whether FFN node `name` applies the identity experts (routing ffn: one node does; routing
        attention: the attention nodes do, and no FFN node)."""
        return self.routing == "ffn" and name == (self.layout.zero_experts or self.ffn_nodes[0].name)

    def to_dict(self) -> dict:
        """The cluster YAML of this config (what `from_dict` reads back into an equal config): every value that
        differs from its default, plus the required ones."""
        doc: dict = {}
        for key in SECTION_KEYS:
            section = _changed(getattr(self, key), key, self.given | {"model.path"})
            if section or key in self.given:
                doc[key] = section
        keep = {f"nodes.{i}.{k}" for i in range(len(self.nodes)) for k in ("name", "role", "host", "ports")}
        doc["nodes"] = [_changed(n, f"nodes.{i}", self.given | keep) for i, n in enumerate(self.nodes)]
        return doc

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @property
    def topology_name(self) -> str:
        lay = self.layout
        tp = f" (attention tp {lay.attention_tp}, {lay.tp_comm})" if lay.attention_tp > 1 else ""
        return f"{len(self.attention_nodes)}A{len(self.ffn_nodes)}F{tp}"


def _changed(obj, path: str, keep: frozenset[str] | set[str]) -> dict:
    """A section's fields at `path` that differ from their defaults or whose path is in `keep`, as YAML values."""
    out = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if f"{path}.{f.name}" in keep or value != f.default:
            if isinstance(value, Ports):
                value = {k: v for k, v in _changed(value, f"{path}.ports", keep).items() if v is not None}
            elif f.name.endswith("_bytes"):
                value = _size_text(value)
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, dict):
                value = {k: list(v) if isinstance(v, tuple) else v for k, v in value.items()}
            out[f.name] = value
    return out


def _size_text(n: int) -> int | str:
    """A byte count as the YAML writes it: in the largest binary unit that divides it, else plain."""
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n % mult == 0:
            return f"{n // mult}{unit}"
    return n
