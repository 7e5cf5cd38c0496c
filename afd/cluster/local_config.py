"""Cluster configs made for one host: what `afd serve`, `afd.LLM` and the tests run, every node on loopback
(or the given hosts) with free ports. They are ClusterConfigs like any loaded YAML (`to_yaml()` writes the
file the nodes start from)."""

from __future__ import annotations

from typing import Any

from afd.cluster.host import free_ports
from afd.cluster.schema import ClusterConfig


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
    from afd.cluster.config import from_dict

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
