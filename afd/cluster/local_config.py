"""Cluster configs made for one host: what `afd serve`, `afd.LLM` and the tests run, every node on loopback
(or the given hosts) with free ports. They are ClusterConfigs like any loaded YAML (`to_yaml()` writes the
file the nodes start from)."""

from __future__ import annotations

import dataclasses
from typing import Any

from afd.cluster.host import free_ports
from afd.config.schema import ClusterConfig

OFFLINE_CLUSTER = {"startup_timeout": 120.0, "rejoin_timeout": 0.0}
"""The cluster section of an offline job (`local_job`): it is not re-formed around a failed node (rejoin_timeout
0), it fails naming it; a node restarted by the job's supervisor must stay up startup_timeout to end a row."""


def local_config(
    attention_nodes: int,
    ffn_nodes: int,
    sections: dict[str, dict[str, Any]] | None = None,
    *,
    name: str = "local",
    device: str = "cpu",
    host: str = "127.0.0.1",
    ffn_host: str | None = None,
    http_port: int | None = None,
    metrics_ports: bool = False,
    threads: int | None = None,
    source: str = "<local>",
) -> ClusterConfig:
    """A cluster of `attention_nodes` attention and `ffn_nodes` FFN nodes: `sections` ({section: {field:
    value}}) over the defaults, each process on a device index of its own (attention node i's TP rank r on
    i * attention_tp + r, then FFN node i on attention_nodes * attention_tp + i), HTTP ports from `http_port`
    up (default: free ones), FFN metrics ports with `metrics_ports`."""
    from afd.config.loader import from_dict

    sections = {k: dict(v) for k, v in (sections or {}).items()}
    A, F = attention_nodes, ffn_nodes
    G = sections.get("layout", {}).get("attention_tp", 1)
    ports = iter(free_ports(3 * (A + F)))
    nodes = []
    for i in range(A):
        http = next(ports) if http_port is None else http_port + i
        nodes.append(
            _node(
                f"attn{i}", "attention", host, device, i * G, threads, control=next(ports), data=next(ports), http=http
            )
        )
    for i in range(F):
        extra = {"metrics": next(ports)} if metrics_ports else {}
        nodes.append(
            _node(
                f"ffn{i}",
                "ffn",
                ffn_host or host,
                device,
                A * G + i,
                threads,
                control=next(ports),
                data=next(ports),
                **extra,
            )
        )
    cluster = {"name": name, "coordinator": "attn0", **sections.pop("cluster", {})}
    model = {"path": "demo", **sections.pop("model", {})}
    return from_dict({"cluster": cluster, "model": model, **sections, "nodes": nodes}, source)


def _node(name: str, role: str, host: str, device: str, index: int, threads: int | None, **ports: int) -> dict:
    node: dict = {"name": name, "role": role, "host": host, "ports": ports}
    if device != "cpu":
        node["device"] = f"{device}:{index}"
    if threads is not None:
        node["threads"] = threads
    return node


def local_job(
    model: str,
    attention_nodes: int = 1,
    ffn_nodes: int = 1,
    *,
    host: str = "127.0.0.1",
    ffn_host: str | None = None,
    threads: int | None = 1,
    **fields: Any,
) -> ClusterConfig:
    """The cluster of an offline job on this machine (what afd.LLM's node processes, afd.cluster.local and the
    benchmarks run): `fields` are the config's fields by name, as afd.LLM's keywords (afd.config.flags:
    `dtype="bfloat16"`, `max_num_seqs=3`), over the defaults and OFFLINE_CLUSTER."""
    from afd.config.flags import flat_overrides

    if attention_nodes < 1 or ffn_nodes < 0:
        raise ValueError(
            "need at least one attention node (and 0 or more FFN nodes: 0 runs the experts on the attention nodes)"
        )
    sections = flat_overrides({**fields, "path": model})
    sections["cluster"] = OFFLINE_CLUSTER | sections.get("cluster", {})
    return local_config(
        attention_nodes, ffn_nodes, sections, name="local-job", host=host, ffn_host=ffn_host, threads=threads
    )


def with_free_ports(cfg: ClusterConfig, ffn_metrics: bool = False) -> ClusterConfig:
    """`cfg` with every port its nodes name picked anew, free now (a job's nodes bind them seconds later); with
    `ffn_metrics`, every FFN node also gets a metrics port (its /metrics)."""
    wanted = []
    for n in cfg.nodes:
        named = {k for k, v in dataclasses.asdict(n.ports).items() if v is not None}
        wanted.append(sorted(named | ({"metrics"} if ffn_metrics and n.role == "ffn" else set())))
    fresh = iter(free_ports(sum(map(len, wanted))))
    nodes = tuple(
        dataclasses.replace(n, ports=dataclasses.replace(n.ports, **{k: next(fresh) for k in keys}))
        for n, keys in zip(cfg.nodes, wanted)
    )
    return dataclasses.replace(cfg, nodes=nodes)
