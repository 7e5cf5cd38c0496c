"""The cluster YAML: every node, the model, the parallel layout, the serving engine.

Loaded and checked here into the frozen dataclasses of afd.config.schema (re-exported: import them from
here). Every mistake raises ClusterConfigError naming the key path (`nodes[1].ports.http: ...`);
`afd check-config` prints it and exits 2.
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass, field, fields
from typing import Any, NoReturn

import yaml

from afd.config.fieldspec import byte_count, rule_of
from afd.config.http_section import HttpSection
from afd.config.placement import Placement, PlacementError, parse_experts
from afd.config.schema import ClusterConfig, ClusterConfigError, Node, Ports
from afd.config.sections import (
    DEVICES,
    ROLES,
    SECTION_KEYS,
    ClusterSection,
    EngineSection,
    Layout,
    ModelSection,
    PrefetchSection,
)
from afd.config.tp import TPConfigError

# ---- loading and validation -------------------------------------------------------------------


def _fail(src: str, path: str, msg: str) -> NoReturn:
    raise ClusterConfigError(f"{src}: {path}: {msg}" if path else f"{src}: {msg}")


_TYPE_NAMES = {int: "int", float: "float", bool: "bool", str: "str", dict: "dict", list: "list", tuple: "list"}
_TYPE_CHECKS = {
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    bool: lambda v: isinstance(v, bool),
    str: lambda v: isinstance(v, str) and v != "",
    dict: lambda v: isinstance(v, dict),
    list: lambda v: isinstance(v, list),
    tuple: lambda v: isinstance(v, (list, tuple)),
}


def _check_type(src: str, path: str, value: Any, typ: Any) -> Any:
    """`value` against a field's resolved annotation (`int`, `float | None`, ...): the value, floats as float."""
    args = typing.get_args(typ)
    if args and type(None) in args:  # X | None
        if value is None:
            return None
        typ = next(a for a in args if a is not type(None))
    base = typing.get_origin(typ) or typ
    check = _TYPE_CHECKS.get(base)
    if check is not None and not check(value):
        _fail(src, path, f"expected {_TYPE_NAMES[base]}, got {type(value).__name__} {value!r}")
    return float(value) if base is float else value


def _section(cls, src: str, path: str, raw: Any, required: tuple[str, ...] = ()):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        _fail(src, path, f"expected a mapping, got {type(raw).__name__}")
    declared = {f.name: f for f in fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in declared:
            _fail(src, f"{path}.{key}" if path else str(key), f"unknown key (known: {', '.join(declared)})")
    for key in required:
        if key not in raw:
            _fail(src, f"{path}.{key}", "required key is missing")
    kw = {}
    for k, v in raw.items():
        if k.endswith("_bytes") and v is not None:  # a size, as to_dict writes it back (256MiB)
            v = parse_bytes(src, f"{path}.{k}", v)
        kw[k] = _check_type(src, f"{path}.{k}", v, hints[k])
        rule = rule_of(declared[k])
        if rule is not None and (why := rule.why_not(kw[k])) is not None:
            _fail(src, f"{path}.{k}", why)
    return kw


def parse_bytes(src: str, path: str, v: Any) -> int:
    value = byte_count(v) if not isinstance(v, str) or not v.isdigit() else None
    if value is None:
        _fail(src, path, f"expected a byte count like 256MiB, got {v!r}")
    return value


def _batch_sizes(src: str, v: Any) -> tuple[int, ...]:
    """engine.graph_batch_sizes: a non-empty list of positive ints, kept sorted and without repeats."""
    if not isinstance(v, (list, tuple)) or not v or not all(type(b) is int and b > 0 for b in v):
        _fail(src, "engine.graph_batch_sizes", f"expected a non-empty list of positive batch sizes, got {v!r}")
    return tuple(sorted(set(v)))


@dataclass
class _Ctx:
    src: str
    seen_ports: dict = field(default_factory=dict)
    seen_devices: dict = field(default_factory=dict)
    attention_tp: int = 1
    share_devices: bool = False


def _load_node(ctx: _Ctx, i: int, raw: Any) -> Node:
    path = f"nodes[{i}]"
    kw = _section(Node, ctx.src, path, raw, required=("name", "role", "host", "ports"))
    if kw["role"] not in ROLES:
        _fail(ctx.src, f"{path}.role", f"must be one of {', '.join(ROLES)}, got {kw['role']!r}")
    dev = kw.get("device", "cpu")
    dtype, _, idx = str(dev).partition(":")
    if dtype not in DEVICES or (idx and not idx.isdigit()):
        _fail(ctx.src, f"{path}.device", f"expected cpu, cuda[:N] or npu[:N], got {dev!r}")
    ranks = ctx.attention_tp if kw["role"] == "attention" else 1
    for r in range(ranks if dtype != "cpu" else 0):  # hosts compare as written, as for ports; `cuda` is cuda:0
        where = (kw["host"], dtype, int(idx or 0) + r)
        who = kw["name"] if r == 0 else f"{kw['name']} TP rank {r}"
        if where in ctx.seen_devices and not (ctx.share_devices and dtype == "cuda"):
            _fail(
                ctx.src,
                f"{path}.device",
                f"{who} and {ctx.seen_devices[where]} both use {dtype}:{where[2]} "
                f"on {kw['host']}: give each node its own device (NCCL and HCCL take "
                "one process per device; TP rank r of an attention node takes the "
                "node's device index + r)"
                + ("; cluster.share_devices lets CUDA nodes share one, not NPU nodes" if dtype == "npu" else ""),
            )
        ctx.seen_devices.setdefault(where, f"{who} (nodes[{i}].device {dev!r})")
    if ".tp" in kw["name"]:
        _fail(ctx.src, f"{path}.name", f"{kw['name']!r}: `.tp` is reserved for the names of TP ranks (NODE.tpR)")
    pk = _section(Ports, ctx.src, f"{path}.ports", kw["ports"], required=("control", "data"))
    for name, port in pk.items():
        if port is None:
            continue
        if not 1 <= port <= 65535:
            _fail(ctx.src, f"{path}.ports.{name}", f"port {port} outside 1..65535")
        at = (kw["host"], port)
        if at in ctx.seen_ports:
            _fail(
                ctx.src,
                f"{path}.ports.{name}",
                f"port {port} on {kw['host']} is already used by {ctx.seen_ports[at]}",
            )
        ctx.seen_ports[at] = f"{kw['name']}.ports.{name}"
    if kw["role"] == "attention" and pk.get("http") is None:
        _fail(ctx.src, f"{path}.ports.http", "attention nodes need an http port")
    if kw["role"] == "ffn" and pk.get("http") is not None:
        _fail(ctx.src, f"{path}.ports.http", "FFN nodes serve no API; use ports.metrics")
    return Node(ports=Ports(**pk), **{k: v for k, v in kw.items() if k != "ports"})


def _check_layout(src: str, layout: Layout, nodes: list[Node]) -> None:
    ffn = [n.name for n in nodes if n.role == "ffn"]
    try:
        layout.tp  # noqa: B018 (validates)
    except TPConfigError as e:
        _fail(src, "", str(e))
    if layout.zero_experts is not None and layout.zero_experts not in ffn:
        _fail(src, "layout.zero_experts", f"{layout.zero_experts!r} is not an FFN node ({', '.join(ffn)})")
    if layout.placement is not None:
        if not isinstance(layout.placement, dict) or set(layout.placement) != set(ffn):
            got = (
                ", ".join(map(str, layout.placement)) if isinstance(layout.placement, dict) else repr(layout.placement)
            )
            _fail(src, "layout.placement", f"must name every FFN node exactly ({', '.join(ffn)}); got {got}")
        for name, spec in layout.placement.items():
            try:
                parse_experts(spec)
            except PlacementError as e:
                _fail(src, f"layout.placement.{name}", str(e))


def check_expert_layout(cfg: ClusterConfig, n_routed: int, groups: int = 1) -> Placement | None:
    """The placement against the model (every expert held, ids in range, a node for each); replicas only
    under routing attention (routing ffn sends every token to every holder, which would add a replicated
    expert's share twice). Returns it (None without FFN nodes)."""
    if cfg.colocated:
        return None
    try:
        p = cfg.placement(n_routed, groups)
    except PlacementError as e:
        where = "layout.placement" if cfg.layout.placement else "nodes"
        raise ClusterConfigError(f"{cfg.source}: {where}: {e}") from None
    if p.replicated and cfg.routing == "ffn":
        raise ClusterConfigError(
            f"{cfg.source}: layout.placement: replicated experts need layout.routing attention (routing ffn "
            "sends every token to every holder of an expert)"
        )
    return p


def check_tp_layout(cfg: ClusterConfig, num_heads: int) -> None:
    """The TP layout against the model: each rank holds whole attention heads."""
    try:
        cfg.layout.tp.check_model(num_heads)
    except TPConfigError as e:
        raise ClusterConfigError(f"{cfg.source}: {e}") from None


def check_routing(cfg: ClusterConfig, model_cfg) -> None:
    """A router that reads the token ids (DeepSeek-V4's hash layers: `routes_by_token_ids` on the family's
    config) runs where they are, the attention side: routing ffn's broadcast carries only the hidden states.
    Left unset, layout.routing is attention for such a family (afd.cluster.topology.with_model_defaults, where
    every process starts): only an explicit routing ffn is refused."""
    if model_cfg.routes_by_token_ids and cfg.layout.routing == "ffn":
        raise ClusterConfigError(
            f"{cfg.source}: layout.routing: {model_cfg.model_type}'s routers read the token ids, which routing ffn "
            "does not send to the FFN nodes: set layout.routing: attention (or leave it unset)"
        )


def _check_tls(src: str, tls: dict | None) -> None:
    if tls is None:
        return
    for key, value in tls.items():
        if key not in ("cert", "key", "ca"):
            _fail(src, f"cluster.tls.{key}", "unknown key (known: cert, key, ca)")
        if not isinstance(value, str) or not value:
            _fail(src, f"cluster.tls.{key}", f"expected a file path, got {value!r}")
    if ("cert" in tls) != ("key" in tls):
        _fail(src, "cluster.tls", "cert and key go together")


def _load_http(src: str, raw: Any) -> HttpSection:
    http = HttpSection(**_section(HttpSection, src, "http", raw))
    if (http.ssl_certfile is None) != (http.ssl_keyfile is None):
        _fail(src, "http", "ssl_certfile and ssl_keyfile go together")
    return http


def from_dict(raw: Any, src: str = "<dict>") -> ClusterConfig:
    if not isinstance(raw, dict):
        _fail(src, "", "the file must be a YAML mapping")
    allowed = (*SECTION_KEYS, "nodes")
    for key in raw:
        if key not in allowed:
            _fail(src, str(key), f"unknown key (known: {', '.join(allowed)})")
    for key in ("model", "nodes"):
        if key not in raw:
            _fail(src, key, "required key is missing")
    cluster = ClusterSection(**_section(ClusterSection, src, "cluster", raw.get("cluster")))
    _check_tls(src, cluster.tls)
    model = ModelSection(**_section(ModelSection, src, "model", raw["model"], required=("path",)))
    layout = Layout(**_section(Layout, src, "layout", raw.get("layout")))
    eng_raw = dict(raw.get("engine") or {})
    if "graph_batch_sizes" in eng_raw:
        eng_raw["graph_batch_sizes"] = _batch_sizes(src, eng_raw["graph_batch_sizes"])
    engine = EngineSection(**_section(EngineSection, src, "engine", eng_raw))
    prefetch = PrefetchSection(**_section(PrefetchSection, src, "prefetch", raw.get("prefetch")))
    for i, w in enumerate(prefetch.weights or []):
        if w not in ("router", "gate_up", "down"):
            _fail(src, f"prefetch.weights[{i}]", f"expected router, gate_up or down, got {w!r}")
    http = _load_http(src, raw.get("http"))
    if not isinstance(raw["nodes"], list) or not raw["nodes"]:
        _fail(src, "nodes", "expected a non-empty list of nodes")
    ctx = _Ctx(
        src,
        attention_tp=layout.attention_tp if type(layout.attention_tp) is int else 1,
        share_devices=cluster.share_devices is True,
    )
    nodes, names = [], set()
    for i, n in enumerate(raw["nodes"]):
        node = _load_node(ctx, i, n)
        if node.name in names:
            _fail(src, f"nodes[{i}].name", f"duplicate node name {node.name!r}")
        names.add(node.name)
        nodes.append(node)
    if not any(n.role == "attention" for n in nodes):
        _fail(src, "nodes", "needs at least one attention node")  # without FFN nodes: colocated (.colocated)
    if cluster.coordinator is not None and cluster.coordinator not in names:
        _fail(src, "cluster.coordinator", f"{cluster.coordinator!r} is not a node ({', '.join(sorted(names))})")
    _check_layout(src, layout, nodes)
    cfg = ClusterConfig(cluster, model, layout, engine, tuple(nodes), prefetch, src, _given(raw), http)
    check_speculative(cfg)
    return cfg


def _given(raw: dict) -> frozenset[str]:
    """The key paths a loaded YAML spelled out (ClusterConfig.given)."""
    out = {f"{s}.{k}" for s in SECTION_KEYS for k in (raw.get(s) or {})}
    out |= {s for s in SECTION_KEYS if s in raw}
    for i, node in enumerate(raw["nodes"]):
        out |= {f"nodes.{i}.{k}" for k in node} | {f"nodes.{i}.ports.{k}" for k in node.get("ports") or {}}
    return frozenset(out)


def check_speculative(cfg: ClusterConfig) -> None:
    """engine.speculative_tokens against the layout: MTP runs on a single-rank attention node for now (the
    drafts' KV cache layer is not cut across TP ranks), and not with KV-parallel attention, which seed
    001 does not support with MTP either."""
    n, lay = cfg.engine.speculative_tokens, cfg.layout
    if type(n) is not int or not 0 <= n <= 2:
        _fail(cfg.source, "engine.speculative_tokens", f"must be 0 (off), 1 or 2, got {n!r}")
    if n and getattr(lay, "kvp", 1) > 1:
        _fail(
            cfg.source,
            "engine.speculative_tokens",
            f"MTP speculative decoding does not run with KV-parallel "
            f"attention (layout.kvp {lay.kvp}): use one or the other",
        )
    if n and lay.attention_tp > 1:
        _fail(
            cfg.source,
            "engine.speculative_tokens",
            f"MTP speculative decoding with layout.attention_tp "
            f"{lay.attention_tp} is not supported yet: use attention_tp 1",
        )


def load(path: str) -> ClusterConfig:
    if not os.path.isfile(path):
        raise ClusterConfigError(f"{path}: no such file")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ClusterConfigError(f"{path}: not valid YAML: {e}") from None
    return from_dict(raw, path)
