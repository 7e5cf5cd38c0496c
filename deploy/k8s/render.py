"""The manifests of this folder for another cluster size: nA attention + mF FFN nodes.

A role's size lives in two places that must agree, its StatefulSet's `replicas` and its nodes in the
ConfigMap's cluster YAML (named and addressed as the StatefulSet's pods); this changes both together:

    python deploy/k8s/render.py --attention 2 --ffn 1 | kubectl -n afd apply -f -

New nodes copy the first node of their role in configmap.yaml (device, ports). The output carries no
comments; the files here are the documented source. tests/test_k8s_manifests.py validates its output.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROLE_LABEL = "llm-d.ai/role"
ROLES = ("attention", "ffn")


def load(directory: Path = HERE) -> list[dict]:
    """Every document of the folder's *.yaml files (what `kubectl apply -f DIR` applies), in file order."""
    docs: list[dict] = []
    for path in sorted(directory.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def render(docs: list[dict], attention: int, ffn: int) -> list[dict]:
    """A copy of `docs` with each role's StatefulSet at its count and the cluster YAML listing those pods."""
    counts = {"attention": attention, "ffn": ffn}
    if min(counts.values()) < 1:
        raise ValueError(f"each role needs at least one node, got {counts}")
    docs = copy.deepcopy(docs)
    sets = {d["metadata"]["labels"][ROLE_LABEL]: d for d in docs if d["kind"] == "StatefulSet"}
    for role, sts in sets.items():
        sts["spec"]["replicas"] = counts[role]
    for cm in (d for d in docs if d["kind"] == "ConfigMap" and "cluster.yaml" in d.get("data", {})):
        cluster = yaml.safe_load(cm["data"]["cluster.yaml"])
        cluster["nodes"] = [n for role in ROLES for n in _nodes(cluster["nodes"], sets[role], counts[role], role)]
        cm["data"]["cluster.yaml"] = yaml.safe_dump(cluster, sort_keys=False)
    return docs


def _nodes(nodes: list[dict], sts: dict, count: int, role: str) -> list[dict]:
    """`count` nodes of `role` named <statefulset>-<ordinal> at <pod>.<headless service>, which is what
    the pods pass as --node and where their DNS names point."""
    template = next(n for n in nodes if n["role"] == role)
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    return [{**copy.deepcopy(template), "name": f"{name}-{i}", "host": f"{name}-{i}.{service}"} for i in range(count)]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the embedded cluster YAML) as literal blocks, so the output stays readable."""


def _str(dumper: yaml.SafeDumper, s: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)


_Dumper.add_representer(str, _str)


def dump(docs: list[dict]) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attention", type=int, required=True, help="attention nodes (pods)")
    p.add_argument("--ffn", type=int, required=True, help="FFN nodes (pods)")
    p.add_argument("--dir", type=Path, default=HERE, help="folder of manifests (default: this one)")
    args = p.parse_args(argv)
    try:
        sys.stdout.write(dump(render(load(args.dir), args.attention, args.ffn)))
    except ValueError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
