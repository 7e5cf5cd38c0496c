"""Device indices against the device count: a YAML that asks for `cuda:5` on a 2-GPU machine is refused in
one line (`device cuda:5: this machine has 2 CUDA devices (cuda:0-1)`) by `afd launch`, `afd serve` and a
node started alone, before any process starts, instead of six node processes dying in set_device.

In process the count is monkeypatched (afd.backend.devices._device_count); the commands run against the
fake torch_npu (tests/fakes on PYTHONPATH), whose device count is AFD_FAKE_NPU_COUNT.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from afd.backend import DeviceUnavailable, check_device, check_devices, devices, get_backend
from afd.cluster.processes import free_ports
from afd.config.loader import load

ROOT = Path(__file__).resolve().parent.parent
FAKES = str(Path(__file__).parent / "fakes")


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n): this machine has n CUDA devices, as far as afd.backend can tell."""

    def make(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(devices, "_device_count", lambda kind: {"cuda": n}[kind])
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    return make


def _refusal(names) -> str:
    with pytest.raises(DeviceUnavailable) as e:
        check_devices(names)
    return str(e.value)


def test_an_index_beyond_the_count_is_named_with_the_count(gpus):
    gpus(2)
    check_devices(["cuda:0", "cuda:1", "cuda", "cpu"])
    assert _refusal(["cuda:0", "cuda:5"]) == "device cuda:5: this machine has 2 CUDA devices (cuda:0-1)"
    # deploy/cuda.yaml on two GPUs: every missing device in the one line
    assert _refusal([f"cuda:{i}" for i in range(8)]) == (
        "devices cuda:2, cuda:3, cuda:4, cuda:5, cuda:6, cuda:7: this machine has 2 CUDA devices (cuda:0-1)"
    )
    gpus(1)
    with pytest.raises(DeviceUnavailable, match=r"^device cuda:1: this machine has 1 CUDA device \(cuda:0\)$"):
        check_device("cuda:1")


def test_the_count_of_the_visible_devices_says_which_variable_narrowed_it(gpus, monkeypatch):
    gpus(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert _refusal(["cuda:1"]) == "device cuda:1: CUDA_VISIBLE_DEVICES=3 leaves 1 CUDA device (cuda:0)"


def test_no_device_of_the_kind_is_said_before_any_index(gpus):
    gpus(0)
    assert "no CUDA device is visible" in _refusal(["cuda:3"])
    assert _refusal(["cuda:1x"]) == "unknown device 'cuda:1x'; expected one of cpu, cuda, npu or 'auto'"


def test_the_cuda_backend_refuses_an_index_beyond_the_count_before_set_device(gpus, monkeypatch):
    gpus(2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device reached"))
    with pytest.raises(DeviceUnavailable, match=r"^device cuda:2: this machine has 2 CUDA devices \(cuda:0-1\)$"):
        get_backend("cuda", 2)


def test_the_cuda_examples_on_a_two_gpu_machine(gpus):
    """deploy/cuda.yaml (4A4F on cuda:0-7) is refused there, naming the six GPUs it lacks; cuda-1a1f.yaml fits."""
    gpus(2)
    check_devices(p.device for p in load(str(ROOT / "deploy/cuda-1a1f.yaml")).processes)
    assert _refusal(p.device for p in load(str(ROOT / "deploy/cuda.yaml")).processes) == (
        "devices cuda:2, cuda:3, cuda:4, cuda:5, cuda:6, cuda:7: this machine has 2 CUDA devices (cuda:0-1)"
    )


# ---- the commands, on the fake NPU -------------------------------------------------------------------------


def _yaml(path: Path, devices: dict[str, str], attention_tp: int = 1) -> str:
    ports = iter(free_ports(3 * len(devices)))
    nodes = []
    for name, device in devices.items():
        role = "attention" if name.startswith("attn") else "ffn"
        p = {"control": next(ports), "data": next(ports)} | ({"http": next(ports)} if role == "attention" else {})
        nodes.append({"name": name, "role": role, "host": "127.0.0.1", "device": device, "ports": p})
    cfg = {"cluster": {"name": "t", "coordinator": "attn0"}, "model": {"path": "demo"}, "nodes": nodes}
    cfg["layout"] = {"attention_tp": attention_tp}
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _run(argv: list[str], count: int) -> tuple[subprocess.CompletedProcess, float]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([FAKES, str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "AFD_FAKE_NPU_COUNT": str(count),
    }
    env.pop("ASCEND_RT_VISIBLE_DEVICES", None)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    return r, time.monotonic() - t0


def _processes_naming(text: str) -> list[int]:
    """Processes whose command line mentions `text` (what a started node's would)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(pid))
    return found


def test_every_command_refuses_a_device_beyond_the_count_in_one_line(tmp_path):
    """2 NPUs here. `afd launch` refuses the whole YAML before any node starts; each node started alone
    (one on an NPU that is here would start, so none is) and a TP rank beyond the count say it as well;
    `afd serve` says how many devices its nodes need."""
    cluster = _yaml(tmp_path / "cluster.yaml", {"attn0": "npu:0", "attn1": "npu:2", "ffn0": "npu:3"})
    tp = _yaml(tmp_path / "tp.yaml", {"attn0": "npu:1", "ffn0": "npu:0"}, attention_tp=2)
    have = "this machine has 2 NPU devices (npu:0-1)"
    cases = {
        ("-m", "afd", "launch", cluster): f"afd launch: error: {cluster}: devices npu:2, npu:3: {have}",
        ("-m", "attention_node.main", "--config", cluster, "--node", "attn1"): (
            f"afd-attention: error: {cluster}: node attn1: device npu:2: {have}"
        ),
        ("-m", "ffn_node.main", "--config", cluster, "--node", "ffn0"): (
            f"afd-ffn: error: {cluster}: node ffn0: device npu:3: {have}"
        ),
        ("-m", "attention_node.main", "--config", tp, "--node", "attn0", "--tp-rank", "1"): (
            f"afd-attention: error: {tp}: node attn0 TP rank 1: device npu:2: {have}"
        ),
        (
            "-m",
            "afd",
            "serve",
            "demo",
            "--device",
            "npu",
            "--attention-nodes",
            "2",
            "--ffn-nodes",
            "1",
        ): (
            f"afd serve: error: device npu:2: {have}; afd serve gives every process its own device: "
            "2 attention nodes and 1 FFN node need 3"
        ),
    }
    with ThreadPoolExecutor(2) as pool:
        runs = dict(zip(cases, pool.map(lambda argv: _run(list(argv), 2), cases)))
    for argv, (r, seconds) in runs.items():
        assert (r.returncode, r.stderr.splitlines(), r.stdout) == (2, [cases[argv]], ""), argv
        assert seconds < 60, (argv, seconds)  # torch's import, nothing more
    assert not _processes_naming(str(tmp_path)), "a node process was left behind"


def test_the_same_yaml_passes_the_device_check_with_enough_devices(tmp_path):
    """With 4 NPUs the check lets it through, and NpuBackend refuses npu:4 itself (what builds a backend
    without a launcher); --print-commands is never checked: it starts nothing."""
    cluster = _yaml(tmp_path / "cluster.yaml", {"attn0": "npu:0", "attn1": "npu:2", "ffn0": "npu:3"})
    code = (
        "from afd.config.loader import load\nfrom afd.backend import check_devices, get_backend\n"
        f"check_devices(p.device for p in load({cluster!r}).processes)\n"
        "try:\n    get_backend('npu', 4)\nexcept ValueError as e:\n    print(e)\n"
    )
    r, _ = _run(["-c", code], 4)  # and the backend itself, for what builds one without a launcher
    assert (r.returncode, r.stdout.strip()) == (0, "device npu:4: this machine has 4 NPU devices (npu:0-3)"), r.stderr
    r, _ = _run(["-m", "afd", "launch", cluster, "--print-commands"], 1)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 3, r.stderr
