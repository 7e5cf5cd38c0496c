"""The Kubernetes manifests in deploy/k8s/: they parse, run the node commands, and agree with the
cluster YAML they carry."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from afd.cluster.config import ClusterConfig, from_dict

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"


# ---- Kubernetes manifests -----------------------------------------------------------------------

WORKLOADS = ("Deployment", "StatefulSet", "LeaderWorkerSet")


@pytest.fixture(scope="module")
def k8s() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def kind(docs: list[dict], k: str) -> list[dict]:
    return [d for d in docs if d["kind"] == k]


def pod_specs(workload: dict) -> list[dict]:
    """The pod templates of a workload (a LeaderWorkerSet has a leader and a worker template)."""
    spec = workload["spec"]
    if workload["kind"] == "LeaderWorkerSet":
        lws = spec["leaderWorkerTemplate"]
        return [t["spec"] for t in (lws.get("leaderTemplate"), lws["workerTemplate"]) if t]
    return [spec["template"]["spec"]]


def argv(container: dict) -> list[str]:
    return [str(a) for a in container.get("command", []) + container.get("args", [])]


def flag(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]


def port_number(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p.get("name") == port)


def prestop_sleep(container: dict) -> int:
    """Seconds the preStop hook may take: a sleep, or `afd drain ... --wait S`."""
    pre = container["lifecycle"]["preStop"]
    if "sleep" in pre:
        return int(pre["sleep"]["seconds"])
    cmd = pre["exec"]["command"]
    if cmd[:2] == ["sh", "-c"] and cmd[2].startswith("afd drain "):
        words = cmd[2].split()
        return int(words[words.index("--wait") + 1])
    assert cmd[0] == "sleep", cmd
    return int(cmd[1])


@pytest.fixture(scope="module")
def embedded(k8s) -> ClusterConfig:
    (cm,) = [d for d in kind(k8s, "ConfigMap") if "cluster.yaml" in d.get("data", {})]
    return from_dict(yaml.safe_load(cm["data"]["cluster.yaml"]), "ConfigMap/cluster.yaml")


def test_k8s_manifests_parse(k8s):
    assert all({"apiVersion", "kind", "metadata"} <= d.keys() for d in k8s)
    assert kind(k8s, "ConfigMap") and kind(k8s, "Service")
    assert {d["metadata"]["name"] for d in k8s if d["kind"] in WORKLOADS}


def test_k8s_embedded_cluster_yaml_is_valid(embedded):
    assert embedded.attention_nodes and embedded.ffn_nodes
    assert embedded.rank(embedded.coordinator.name) == 0


def test_k8s_containers_run_the_node_commands(k8s):
    roles = set()
    for w in (d for d in k8s if d["kind"] in WORKLOADS):
        for pod in pod_specs(w):
            (c,) = pod["containers"]
            args = argv(c)
            assert args[0] in ("afd-attention", "afd-ffn"), args
            role = "attention" if args[0] == "afd-attention" else "ffn"
            roles.add(role)
            assert w["spec"]["template"]["metadata"]["labels"]["llm-d.ai/role"] == role
            assert flag(args, "--node") == "$(NODE_NAME)"
            assert flag(args, "--bind-host") == "0.0.0.0"
            env = {e["name"]: e for e in c["env"]}
            assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            assert env["AFD_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]["name"]
            # --config is the ConfigMap's cluster.yaml, mounted
            config = flag(args, "--config")
            mount = next(m for m in c["volumeMounts"] if config.startswith(m["mountPath"].rstrip("/") + "/"))
            volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
            assert config == mount["mountPath"].rstrip("/") + "/cluster.yaml" and "configMap" in volume
    assert roles == {"attention", "ffn"}


def test_k8s_pod_names_and_dns_match_the_nodes(k8s, embedded):
    """A StatefulSet's pods are <name>-<ordinal>: each is a node of its role, at <pod>.<headless service>."""
    services = {s["metadata"]["name"]: s for s in kind(k8s, "Service")}
    for sts in kind(k8s, "StatefulSet"):
        spec = sts["spec"]
        (c,) = spec["template"]["spec"]["containers"]
        role = "attention" if argv(c)[0] == "afd-attention" else "ffn"
        pods = [f"{sts['metadata']['name']}-{i}" for i in range(spec["replicas"])]
        nodes = [n for n in embedded.nodes if n.role == role]
        assert [n.name for n in nodes] == pods
        assert all(n.host == f"{n.name}.{spec['serviceName']}" for n in nodes)
        assert spec.get("podManagementPolicy") == "Parallel"  # pod 0 is never ready alone
        svc = services[spec["serviceName"]]["spec"]
        assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        for n in nodes:
            for name in ("control", "data", "http", "metrics"):
                if getattr(n.ports, name) is not None:
                    assert ports[name] == getattr(n.ports, name), f"{n.name}.ports.{name}"


def test_k8s_probes(k8s, embedded):
    for w in (d for d in k8s if d["kind"] in WORKLOADS):
        for pod in pod_specs(w):
            (c,) = pod["containers"]
            name = argv(c)
            node = next(n for n in embedded.nodes if n.role == ("attention" if name[0] == "afd-attention" else "ffn"))
            if name[0] == "afd-attention":
                for probe in ("startupProbe", "readinessProbe"):
                    get = c[probe]["httpGet"]
                    assert get["path"] == "/v1/models" and port_number(c, get["port"]) == node.ports.http
                live = c["livenessProbe"]["httpGet"]
                assert live["path"] == "/health" and port_number(c, live["port"]) == node.ports.http
            else:
                ready = c["readinessProbe"]["httpGet"]
                assert ready["path"] == "/health" and port_number(c, ready["port"]) == node.ports.metrics
                assert c["livenessProbe"]["grpc"]["port"] == node.ports.control


def test_k8s_grace_period_covers_prestop_and_drain(k8s, embedded):
    for w in (d for d in k8s if d["kind"] in WORKLOADS):
        for pod in pod_specs(w):
            (c,) = pod["containers"]
            drains = "afd drain" in str(c["lifecycle"]["preStop"])
            need = prestop_sleep(c) + (5 if drains else embedded.engine.shutdown_timeout)
            assert pod["terminationGracePeriodSeconds"] >= need, w["metadata"]["name"]


def test_k8s_readme_says_how_to_apply():
    text = (K8S / "README.md").read_text()
    assert "kubectl" in text and "apply -f deploy/k8s" in text and "afd-cluster-token" in text


def test_k8s_secret_name_matches_readme(k8s):
    text = (K8S / "README.md").read_text()
    for w in (d for d in k8s if d["kind"] in WORKLOADS):
        for pod in pod_specs(w):
            env = {e["name"]: e for e in pod["containers"][0]["env"]}
            assert env["AFD_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] in text

