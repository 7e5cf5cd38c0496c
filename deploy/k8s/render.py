"""The manifests of this folder for another cluster size: nA attention + mF FFN nodes, G TP ranks each.

A role's size lives in two places that must agree, its StatefulSet's `replicas` and its nodes in the
ConfigMap's cluster YAML (named and addressed as the StatefulSet's pods); this changes both together:

    python deploy/k8s/render.py --attention 2 --ffn 1 | kubectl -n afd apply -f -

New nodes copy the first node of their role in configmap.yaml (device, ports). `--attention-tp G` (with
`--tp-comm MODE`, `--flashcomm2-otp P`) sets those layout keys, and each attention pod's container then
holds G accelerators and runs the node's G ranks under tp_node.py, shipped in the ConfigMap
`afd-attention-tp` (README.md, "Attention TP"). The output carries no comments; the files here are the
documented source. tests/test_k8s_manifests.py and tests/test_k8s_tp.py validate its output.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROLE_LABEL = "llm-d.ai/role"
ROLES = ("attention", "ffn")
TP_CONFIGMAP, TP_MOUNT, TP_SCRIPT = "afd-attention-tp", "/etc/afd-tp", "tp_node.py"


def load(directory: Path = HERE) -> list[dict]:
    """Every document of the folder's *.yaml files (what `kubectl apply -f DIR` applies), in file order."""
    docs: list[dict] = []
    for path in sorted(directory.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def render(
    docs: list[dict],
    attention: int,
    ffn: int,
    attention_tp: int = 1,
    tp_comm: str | None = None,
    flashcomm2_otp: int | None = None,
) -> list[dict]:
    """A copy of `docs` with each role's StatefulSet at its count and the cluster YAML listing those pods;
    with attention_tp > 1 (or a TP key given), the layout keys set and the attention pods running G ranks."""
    counts = {"attention": attention, "ffn": ffn}
    if min(counts.values()) < 1:
        raise ValueError(f"each role needs at least one node, got {counts}")
    if attention_tp < 1:
        raise ValueError(f"--attention-tp: expected a positive integer, got {attention_tp}")
    # the keys given (attention_tp 1 is the default: a tp-1 render leaves the layout as it is)
    keys = {
        "attention_tp": attention_tp if attention_tp > 1 else None,
        "tp_comm": tp_comm,
        "flashcomm2_otp": flashcomm2_otp,
    }
    layout = {k: v for k, v in keys.items() if v is not None}
    docs = copy.deepcopy(docs)
    sets = {d["metadata"]["labels"][ROLE_LABEL]: d for d in docs if d["kind"] == "StatefulSet"}
    for role, sts in sets.items():
        sts["spec"]["replicas"] = counts[role]
    for cm in (d for d in docs if d["kind"] == "ConfigMap" and "cluster.yaml" in d.get("data", {})):
        cluster = yaml.safe_load(cm["data"]["cluster.yaml"])
        cluster["nodes"] = [n for role in ROLES for n in _nodes(cluster["nodes"], sets[role], counts[role], role)]
        if layout:
            cluster["layout"] = {**(cluster.get("layout") or {}), **layout}
        if attention_tp > 1:
            _check_devices(cluster["nodes"])
        cm["data"]["cluster.yaml"] = yaml.safe_dump(cluster, sort_keys=False)
    if attention_tp > 1:
        _tp_pods(sets["attention"]["spec"]["template"]["spec"], attention_tp)
        docs.insert(docs.index(sets["attention"]), _tp_configmap())  # before the pods that mount it
    return docs


def _nodes(nodes: list[dict], sts: dict, count: int, role: str) -> list[dict]:
    """`count` nodes of `role` named <statefulset>-<ordinal> at <pod>.<headless service>, which is what
    the pods pass as --node and where their DNS names point."""
    template = next(n for n in nodes if n["role"] == role)
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    return [{**copy.deepcopy(template), "name": f"{name}-{i}", "host": f"{name}-{i}.{service}"} for i in range(count)]


def _check_devices(nodes: list[dict]) -> None:
    """A pod's G accelerators are numbered 0..G-1 in its container, and TP rank r runs on the node's
    device index + r: the node's device must be index 0 (or the CPU)."""
    for n in (n for n in nodes if n["role"] == "attention"):
        dev = str(n.get("device", "cpu"))
        if dev.partition(":")[2] not in ("", "0"):
            raise ValueError(
                f"node {n['name']}: device {dev}: with --attention-tp the pod's devices are numbered "
                "from 0 in its container, so the node's device must be index 0"
            )


def _tp_pods(pod: dict, tp: int) -> None:
    """The attention container runs the node command as G ranks under tp_node.py, with G accelerators and
    G times the CPU and memory of a one-rank node (each rank is a process like it)."""
    (c,) = pod["containers"]
    c["command"] = ["python3", f"{TP_MOUNT}/{TP_SCRIPT}", str(tp), *c["command"]]
    for kind in ("limits", "requests"):
        amounts = c.get("resources", {}).get(kind, {})
        for name, amount in amounts.items():
            amounts[name] = _times(amount, tp)
    c["volumeMounts"].append({"name": "tp", "mountPath": TP_MOUNT, "readOnly": True})
    pod["volumes"].append({"name": "tp", "configMap": {"name": TP_CONFIGMAP}})


def _times(amount, n: int):
    """A resource quantity (8, "8", "64Gi", "500m") times n."""
    m = re.fullmatch(r"(\d+)(\D*)", str(amount))
    if m is None:
        raise ValueError(f"resource quantity {amount!r}: --attention-tp scales integer quantities only")
    number, unit = m.groups()
    return int(number) * n if isinstance(amount, int) else f"{int(number) * n}{unit}"


def _tp_configmap() -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": TP_CONFIGMAP, "labels": {"app.kubernetes.io/name": "afd"}},
        "data": {TP_SCRIPT: (HERE / TP_SCRIPT).read_text()},
    }


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
    p.add_argument("--attention-tp", type=int, default=1, help="TP ranks (and accelerators) per attention node")
    p.add_argument("--tp-comm", default=None, help="layout.tp_comm: allreduce, sp, flashcomm1 or flashcomm2")
    p.add_argument("--flashcomm2-otp", type=int, default=None, help="layout.flashcomm2_otp (flashcomm2's P)")
    p.add_argument("--dir", type=Path, default=HERE, help="folder of manifests (default: this one)")
    args = p.parse_args(argv)
    try:
        docs = render(load(args.dir), args.attention, args.ffn, args.attention_tp, args.tp_comm, args.flashcomm2_otp)
        sys.stdout.write(dump(docs))
    except ValueError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
