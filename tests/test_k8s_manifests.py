"""The Kubernetes manifests in deploy/k8s/: they parse, run the node commands, agree with the cluster
YAML they carry, and are valid Kubernetes objects, as shipped and rendered for another size and for
attention TP ranks (their TP specifics and supervisor: tests/test_k8s_tp.py); the image they name is
built by the Dockerfile."""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from afd.config.loader import from_dict
from afd.config.schema import ClusterConfig

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
# A recent release whose schemas kubernetes-validate bundles (pyproject's test extra pins a version that has them).
K8S_VERSION = "1.35"
# Custom resources: kubernetes-validate bundles only the built-in kinds' schemas, and a CRD's schema comes
# from its controller's install manifest, which is not here. None is shipped now; one added is skipped
# by name rather than failing with SchemaNotFoundError.
CUSTOM_KINDS = {"LeaderWorkerSet"}


def _load_render():
    """deploy/k8s/render.py, which is a script beside the manifests, not a package module."""
    spec = importlib.util.spec_from_file_location("afd_k8s_render", K8S / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load_render()


# ---- Kubernetes manifests -----------------------------------------------------------------------

WORKLOADS = ("Deployment", "StatefulSet", "LeaderWorkerSet")


# render.py's arguments per rendering the checks below run on
RENDERS = {
    "2A1F": dict(attention=2, ffn=1),
    "2A1F-tp2": dict(attention=2, ffn=1, attention_tp=2),
    "2A2F-tp4-fc2": dict(attention=2, ffn=2, attention_tp=4, tp_comm="flashcomm2", flashcomm2_otp=2),
}
TP_RENDERS = [name for name, kw in RENDERS.items() if kw.get("attention_tp", 1) > 1]


@pytest.fixture(scope="module")
def shipped() -> list[dict]:
    return render.load(K8S)


def rendered(shipped: list[dict], name: str) -> list[dict]:
    # through the text render.py prints, since that is what `kubectl apply -f -` gets
    return list(yaml.safe_load_all(render.dump(render.render(shipped, **RENDERS[name]))))


# Every check below runs on the files as shipped (2A2F) and as render.py makes them for 2A1F and for
# TP ranks: a size change must keep the StatefulSets, the cluster YAML, the ports and the probes in agreement.
@pytest.fixture(scope="module", params=["shipped", *RENDERS])
def k8s(request, shipped) -> list[dict]:
    return shipped if request.param == "shipped" else rendered(shipped, request.param)


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


TP_SCRIPT = f"{render.TP_MOUNT}/{render.TP_SCRIPT}"


def node_argv(container: dict) -> list[str]:
    """The node command a container runs: its command, or the one tp_node.py runs as every TP rank."""
    args = argv(container)
    if args[:2] == ["python3", TP_SCRIPT]:
        return args[3:]
    return args


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
            args = node_argv(c)
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
        role = "attention" if node_argv(c)[0] == "afd-attention" else "ffn"
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
            name = node_argv(c)
            node = next(n for n in embedded.nodes if n.role == ("attention" if name[0] == "afd-attention" else "ffn"))
            if name[0] == "afd-attention":
                # startup: the server answers (no API key on /version); readiness and liveness: /health,
                # 503 when the engine is dead (/v1/models stays 200 then)
                paths = {"startupProbe": "/version", "readinessProbe": "/health", "livenessProbe": "/health"}
                for probe, path in paths.items():
                    get = c[probe]["httpGet"]
                    assert get["path"] == path and port_number(c, get["port"]) == node.ports.http, probe
                # /health is 503 too while a replaced peer is awaited: liveness must outwait that
                live = c["livenessProbe"]
                cl = embedded.cluster
                assert live["periodSeconds"] * live["failureThreshold"] > cl.rejoin_timeout + cl.heartbeat_timeout
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


# ---- served metrics, volumes ----------------------------------------------------------------------


def metrics_port(role: str, node) -> int | None:
    """Where a node serves /metrics: attention nodes on their API port, FFN nodes on ports.metrics (if any)."""
    return node.ports.http if role == "attention" else node.ports.metrics


def test_k8s_pods_serving_metrics_carry_scrape_annotations(k8s, embedded):
    for w in (d for d in k8s if d["kind"] in WORKLOADS):
        (c,) = w["spec"]["template"]["spec"]["containers"]
        role = "attention" if node_argv(c)[0] == "afd-attention" else "ffn"
        ports = {metrics_port(role, n) for n in embedded.nodes if n.role == role}
        assert len(ports) == 1, f"{role} nodes serve metrics on different ports: one annotation cannot say so"
        (port,) = ports
        if port is None:
            continue
        notes = w["spec"]["template"]["metadata"].get("annotations", {})
        assert notes.get("prometheus.io/scrape") == "true", w["metadata"]["name"]
        assert notes.get("prometheus.io/port") == str(port), w["metadata"]["name"]  # annotation values are strings
        assert notes.get("prometheus.io/path") == "/metrics", w["metadata"]["name"]
        assert port in {p["containerPort"] for p in c["ports"]}


def test_k8s_claimed_volumes_exist(k8s):
    claims = {d["metadata"]["name"]: d for d in kind(k8s, "PersistentVolumeClaim")}
    used = [
        v["persistentVolumeClaim"]["claimName"]
        for w in k8s
        if w["kind"] in WORKLOADS
        for pod in pod_specs(w)
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    ]
    assert used, "the checkpoint volume is no longer a PVC: update this test and README.md"
    for name in used:
        assert name in claims, f"PVC {name} is mounted but never created"
        spec = claims[name]["spec"]
        # pods of both StatefulSets, on different machines, read it at once
        assert set(spec["accessModes"]) & {"ReadOnlyMany", "ReadWriteMany"}, spec["accessModes"]
        assert spec["resources"]["requests"]["storage"]


# ---- schema validation (kubernetes-validate, offline) --------------------------------------------


def validate(doc: dict) -> None:
    """Raises kubernetes_validate.ValidationError; strict: a misspelt or misplaced field fails too."""
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_k8s_manifests_are_valid_kubernetes_objects(k8s):
    checked = 0
    for doc in k8s:
        if doc["kind"] in CUSTOM_KINDS:
            continue  # no bundled schema: see CUSTOM_KINDS
        validate(doc)
        checked += 1
    assert checked >= 7  # 2 StatefulSets, 3 Services, the ConfigMap, the PVC


def test_k8s_rendered_2a1f_is_that_cluster(k8s, embedded):
    sets = {d["metadata"]["name"]: d["spec"]["replicas"] for d in kind(k8s, "StatefulSet")}
    nodes = (len(embedded.attention_nodes), len(embedded.ffn_nodes))
    assert nodes == (sets["afd-attention"], sets["afd-ffn"]) and nodes in {(2, 2), (2, 1)}


def parsed(docs: list[dict]) -> list[dict]:
    """`docs` with the ConfigMap's cluster YAML parsed: render.py rewrites it without the comments."""
    docs = copy.deepcopy(docs)
    for cm in kind(docs, "ConfigMap"):
        cm["data"] = {k: yaml.safe_load(v) for k, v in cm["data"].items()}
    return docs


def test_k8s_render_keeps_the_shipped_size_as_is(shipped):
    assert parsed(render.render(shipped, attention=2, ffn=2)) == parsed(shipped)


@pytest.mark.parametrize("breakage", ["unknown field", "wrong type", "missing required"])
def test_k8s_validation_rejects_a_broken_manifest(shipped, breakage):
    """The check above can fail: a StatefulSet broken three ways is refused."""
    sts = copy.deepcopy(kind(shipped, "StatefulSet")[0])
    validate(copy.deepcopy(sts))
    spec = sts["spec"]
    if breakage == "unknown field":
        spec["replica"] = spec.pop("replicas")
    elif breakage == "wrong type":
        spec["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "control"
    else:
        del spec["selector"]
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(sts)


def test_k8s_readme_manifests_are_valid():
    """The loader pod README.md tells users to apply."""
    blocks = re.findall(r"```yaml\n(.*?)```", (K8S / "README.md").read_text(), re.S)
    docs = [d for b in blocks for d in yaml.safe_load_all(b) if d is not None]
    assert docs
    for doc in docs:
        validate(doc)
