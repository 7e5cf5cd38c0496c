"""Attention TP on Kubernetes (deploy/k8s/): one container per attention node holding a device per rank,
its G ranks run by tp_node.py, which is run here on stub node commands (signals, a rank's exit, the
shutdown grace); render.py's TP flags and refusals. The manifests' general checks, which cover the TP
renderings too: tests/test_k8s_manifests.py."""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import yaml
from test_k8s_manifests import K8S, RENDERS, ROOT, TP_RENDERS, TP_SCRIPT, argv, flag, kind, render, rendered

from afd.config.loader import from_dict
from afd.config.schema import ClusterConfig, process_name


@pytest.fixture(scope="module")
def shipped() -> list[dict]:
    return render.load(K8S)


# ---- attention TP: one container per node, G ranks under tp_node.py ------------------------------


def accelerators(container: dict) -> dict[str, int]:
    """The container's accelerator limits (huawei.com/Ascend910, nvidia.com/gpu): every limit but CPU and memory."""
    limits = container["resources"]["limits"]
    return {k: int(v) for k, v in limits.items() if k not in ("cpu", "memory", "ephemeral-storage")}


def attention_container(docs: list[dict]) -> tuple[dict, dict]:
    (sts,) = [d for d in kind(docs, "StatefulSet") if d["metadata"]["labels"]["llm-d.ai/role"] == "attention"]
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    return sts, c


def test_k8s_shipped_attention_pod_runs_one_rank(shipped):
    """The files as shipped (and any tp-1 render) run the node command itself, on one accelerator."""
    _, c = attention_container(shipped)
    assert argv(c)[0] == "afd-attention" and "--tp-rank" not in argv(c)
    assert list(accelerators(c).values()) == [1]
    assert not [d for d in shipped if d["metadata"]["name"] == render.TP_CONFIGMAP]


def test_k8s_tp_render_of_one_rank_is_the_plain_render(shipped):
    assert render.render(shipped, 2, 1, attention_tp=1) == render.render(shipped, 2, 1)


@pytest.fixture(scope="module", params=TP_RENDERS)
def tp(request, shipped) -> tuple[list[dict], ClusterConfig, dict]:
    docs = rendered(shipped, request.param)
    (cm,) = [d for d in kind(docs, "ConfigMap") if "cluster.yaml" in d.get("data", {})]
    return docs, from_dict(yaml.safe_load(cm["data"]["cluster.yaml"]), request.param), RENDERS[request.param]


def test_k8s_tp_cluster_yaml_sets_the_layout(tp):
    """The rendered cluster YAML loads (from_dict: TP rules, no two processes on one pod's device) with the
    layout asked for; the FFN side is as before."""
    _, cfg, kw = tp
    assert cfg.layout.attention_tp == kw["attention_tp"]
    assert cfg.layout.tp_comm == kw.get("tp_comm", "allreduce")
    assert cfg.layout.flashcomm2_otp == kw.get("flashcomm2_otp")
    assert len(cfg.processes) == kw["attention"] * kw["attention_tp"] + kw["ffn"]


def test_k8s_tp_pod_holds_a_device_per_rank(tp):
    """Each attention pod's container gets G accelerators, numbered 0..G-1 inside it: rank r's device
    (the node's index + r) is one of them and no two ranks share one; FFN pods keep one."""
    docs, cfg, kw = tp
    g = kw["attention_tp"]
    _, c = attention_container(docs)
    (count,) = accelerators(c).values()
    assert count == g
    for node in cfg.attention_nodes:
        procs = [p for p in cfg.processes if p.node is node]
        assert [p.name for p in procs] == [process_name(node.name, r) for r in range(g)]
        assert sorted(int(p.device.split(":")[1]) for p in procs) == list(range(g))
    (ffn,) = [d for d in kind(docs, "StatefulSet") if d["metadata"]["labels"]["llm-d.ai/role"] == "ffn"]
    assert list(accelerators(ffn["spec"]["template"]["spec"]["containers"][0]).values()) == [1]
    # G processes like a one-rank node's in the container: G times its CPU and memory
    one = attention_container(render.load(K8S))[1]["resources"]
    for kind_ in ("requests", "limits"):
        for name, amount in one[kind_].items():
            assert str(c["resources"][kind_][name]) == str(render._times(amount, g)), (kind_, name)


def test_k8s_tp_supervisor_is_shipped_and_mounted(tp):
    docs, _, kw = tp
    sts, c = attention_container(docs)
    args = argv(c)
    assert args[:3] == ["python3", TP_SCRIPT, str(kw["attention_tp"])]
    (cm,) = [d for d in kind(docs, "ConfigMap") if d["metadata"]["name"] == render.TP_CONFIGMAP]
    assert cm["data"] == {render.TP_SCRIPT: (K8S / render.TP_SCRIPT).read_text()}
    assert docs.index(cm) < docs.index(sts)  # exists before the pods that mount it
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == render.TP_MOUNT)
    volume = next(v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == render.TP_CONFIGMAP


# `afd-attention` as tp_node.py finds it on PATH: records its argv, answers SIGTERM, and (STUB_FAIL=R) rank R
# exits 3 once every rank has started.
STUB = """\
import json, os, signal, sys, time
args = sys.argv[1:]
rank = int(args[args.index("--tp-rank") + 1]) if "--tp-rank" in args else 0
out = os.environ["STUB_DIR"]
def note(what):  # written whole, then renamed: the test (and a SIGTERM mid-write) never sees an empty file
    path = os.path.join(out, f"{rank}.{what}")
    with open(path + ".tmp", "w") as f:
        json.dump(args, f)
    os.replace(path + ".tmp", path)
def term(*_):
    note("term")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
note("argv")
if os.environ.get("STUB_FAIL") == str(rank):
    while len([f for f in os.listdir(out) if f.endswith(".argv")]) < int(os.environ["STUB_RANKS"]):
        time.sleep(0.02)
    sys.exit(3)
while True:
    time.sleep(0.02)
"""


def kubelet_expand(args: list[str], env: dict[str, str]) -> list[str]:
    """$(VAR) in a container's command, as the kubelet substitutes it."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def start_pod(docs: list[dict], tmp_path: Path, pod: str, **env: str) -> tuple[subprocess.Popen, Path]:
    """The attention container's command of pod `pod`, with the script from the ConfigMap and the stub node."""
    _, c = attention_container(docs)
    (cm,) = [d for d in kind(docs, "ConfigMap") if d["metadata"]["name"] == render.TP_CONFIGMAP]
    script = tmp_path / render.TP_SCRIPT
    script.write_text(cm["data"][render.TP_SCRIPT])
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    stub = bin_ / "afd-attention"
    stub.write_text(f"#!{sys.executable}\n{STUB}")
    stub.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    args = kubelet_expand(argv(c), {"NODE_NAME": pod})
    assert args[:2] == ["python3", TP_SCRIPT]
    env = {
        **os.environ,
        "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}",
        "STUB_DIR": str(out),
        "STUB_RANKS": args[2],
        **env,
    }
    # its own process group, so that stop() ends the stub ranks too, whatever the script did
    return subprocess.Popen([sys.executable, str(script), *args[2:]], env=env, start_new_session=True), out


def stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def wait_for(cond, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_k8s_tp_supervisor_runs_every_rank_and_stops_them_on_sigterm(tp, tmp_path):
    """The pod's command runs the node's processes of the cluster YAML, rank 0 alone without --tp-rank (it
    serves the ports and probes), and the kubelet's SIGTERM reaches every rank."""
    docs, cfg, kw = tp
    g = kw["attention_tp"]
    node = cfg.attention_nodes[-1]
    proc, out = start_pod(docs, tmp_path, node.name)
    try:
        wait_for(lambda: len(list(out.glob("*.argv"))) == g)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        stop(proc)
    base = ["--config", "/etc/afd/cluster.yaml", "--node", node.name, "--bind-host", "0.0.0.0"]
    started = {}
    for r in range(g):
        args = json.loads((out / f"{r}.argv").read_text())
        assert args == base + (["--tp-rank", str(r)] if r else [])
        started[process_name(flag(args, "--node"), int(flag(args, "--tp-rank")) if r else 0)] = r
        assert (out / f"{r}.term").exists(), f"rank {r} got no SIGTERM"
    assert list(started) == [p.name for p in cfg.processes if p.node is node]


@pytest.mark.parametrize("which", ["rank 0", "last rank"])
def test_k8s_tp_supervisor_a_rank_that_exits_takes_the_node_down(tp, tmp_path, which):
    """One rank exits: the others get SIGTERM and the container exits with its code, so the kubelet
    restarts every rank of the node together."""
    docs, cfg, kw = tp
    g = kw["attention_tp"]
    failed = 0 if which == "rank 0" else g - 1
    proc, out = start_pod(docs, tmp_path, cfg.attention_nodes[0].name, STUB_FAIL=str(failed))
    try:
        assert proc.wait(20) == 3
    finally:
        stop(proc)
    assert sorted(p.name for p in out.glob("*.term")) == [f"{r}.term" for r in range(g) if r != failed]


def test_k8s_tp_supervisor_outwaits_the_ranks_own_shutdown(shipped):
    """After one rank exits the others get KILL_AFTER s to stop: more than a rank > 0 waits for rank 0
    (engine.shutdown_timeout + 10), and within what liveness would take anyway."""
    spec = importlib.util.spec_from_file_location("afd_k8s_tp_node", K8S / render.TP_SCRIPT)
    tp_node = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tp_node)
    (cm,) = [d for d in kind(shipped, "ConfigMap") if "cluster.yaml" in d.get("data", {})]
    cfg = from_dict(yaml.safe_load(cm["data"]["cluster.yaml"]))
    assert cfg.engine.shutdown_timeout + 10 < tp_node.KILL_AFTER
    assert tp_node.exit_code([0, -15, 1]) == 143 and tp_node.exit_code([0, 0]) == 0
    assert tp_node.main(["0", "afd-attention"]) == 2


@pytest.mark.parametrize(
    "kw, why",
    [
        (dict(attention_tp=0), "--attention-tp"),
        (dict(attention_tp=2, device="npu:1"), "must be index 0"),
    ],
)
def test_k8s_tp_render_refuses(shipped, kw, why):
    docs = copy.deepcopy(shipped)
    if "device" in kw:
        (cm,) = [d for d in kind(docs, "ConfigMap") if "cluster.yaml" in d.get("data", {})]
        cluster = yaml.safe_load(cm["data"]["cluster.yaml"])
        for n in cluster["nodes"]:
            n["device"] = kw["device"]
        cm["data"]["cluster.yaml"] = yaml.safe_dump(cluster)
    with pytest.raises(ValueError, match=why):
        render.render(docs, 2, 1, attention_tp=kw["attention_tp"])


def test_k8s_render_cli_takes_the_tp_flags(capsys):
    assert (
        render.main(
            [
                "--attention",
                "1",
                "--ffn",
                "1",
                "--attention-tp",
                "4",
                "--tp-comm",
                "flashcomm2",
                "--flashcomm2-otp",
                "2",
            ]
        )
        == 0
    )
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    (cm,) = [d for d in kind(docs, "ConfigMap") if "cluster.yaml" in d.get("data", {})]
    cfg = from_dict(yaml.safe_load(cm["data"]["cluster.yaml"]))
    assert (cfg.layout.attention_tp, cfg.layout.tp_comm, cfg.layout.flashcomm2_otp) == (4, "flashcomm2", 2)
    assert cfg.process_names == ["afd-attention-0", *(f"afd-attention-0.tp{r}" for r in (1, 2, 3)), "afd-ffn-0"]


# ---- the image ------------------------------------------------------------------------------------


def locked_torch_spec() -> str:
    """The lock's torch as a spec without its build label: `torch==2.13.0` for the lock's 2.13.0+cpu."""
    (version,) = re.findall(r"^torch==([^\s+]+)", (ROOT / "requirements.txt").read_text(), re.M)
    return f"torch=={version}"


def test_dockerfile_installs_the_cpu_torch_pin_then_afd():
    text = (ROOT / "Dockerfile").read_text()
    assert f"ARG TORCH_SPEC={locked_torch_spec()}\n" in text  # the torch the test suite runs on
    assert re.search(r"^ARG TORCH_INDEX=\S+/whl/cpu$", text, re.M)  # the CPU build by default
    torch = re.search(r'pip install --index-url "\$\{TORCH_INDEX\}" "\$\{TORCH_SPEC\}"', text)
    afd = re.search(r"^RUN pip install \.", text, re.M)
    assert torch and afd and torch.start() < afd.start()  # else pip would pull torch from PyPI first


def test_dockerfile_copies_the_packages_of_the_node_commands():
    """The manifests run afd-attention, afd-ffn and `afd drain`: their packages must be in the image."""
    text = (ROOT / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\S+) ", text, re.M))
    scripts = {e.name: e.value for e in entry_points(group="console_scripts") if e.name.startswith("afd")}
    assert {"afd", "afd-attention", "afd-ffn"} <= scripts.keys()
    for name in ("afd", "afd-attention", "afd-ffn"):
        assert scripts[name].split(".")[0] in copied, name
    assert not re.search(r"^ENTRYPOINT", text, re.M)  # `docker run IMAGE afd-ffn ...` runs as the manifests do


def test_dockerignore_keeps_the_venv_and_git_out():
    lines = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", ".git"} <= lines
