"""`afd plan` and `afd simulate`: the search keeps only plans under the SLO that fit the devices,
ranks them by tokens/s per device, writes the best as a cluster YAML that check-config accepts, and says which
constraint an impossible request misses and by how much."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from afd.config.loader import load
from afd.entrypoints.cli import main
from afd.plan.costs import CostModel, LayerCosts, Linear, Link
from afd.plan.search import BATCHES, Space

SPECS = Path(__file__).parent.parent / "afd" / "plan" / "specs"


def _rows(out: str) -> list[list[str]]:
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["A", "TP"])
    return [line.split() for line in lines[head + 1 :] if line.strip() and line.split()[0].isdigit()]


def test_plan_ranks_plans_under_the_slo_and_writes_one_check_config_accepts(tmp_path, capsys):
    out_yaml = tmp_path / "plan.yaml"
    assert main(["plan", "--model", "demo", "--hardware", "h200", "--tpot-slo", "2", "--devices", "6",
                 "--output", str(out_yaml)]) == 0  # fmt: skip
    rows = _rows(capsys.readouterr().out)
    assert rows and all(float(r[8]) <= 2.0 for r in rows)  # TPOT ms
    per_device = [float(r[9]) for r in rows]
    assert per_device == sorted(per_device, reverse=True)
    assert all(int(r[7]) <= 6 for r in rows)  # devices
    cfg = load(str(out_yaml))
    best = rows[0]
    assert (len(cfg.attention_nodes), len(cfg.ffn_nodes)) == (int(best[0]), int(best[2]))
    assert cfg.engine.max_num_seqs == int(best[4]) and cfg.layout.micro_batches == int(best[3])
    assert cfg.nodes[0].device_type == "cuda"
    assert main(["check-config", str(out_yaml)]) == 0


def test_an_impossible_slo_names_the_fastest_plan_and_the_miss(capsys):
    assert main(["plan", "--model", "demo", "--hardware", "a3", "--tpot-slo", "0.01", "--devices", "4"]) == 2
    err = capsys.readouterr().err
    assert "no layout meets --tpot-slo 0.01 ms: the fastest predicted step takes" in err and "% over" in err


def test_a_model_that_fits_no_device_says_so(tmp_path, capsys):
    spec = yaml.safe_load((SPECS / "h200.yaml").read_text())
    spec["name"], spec["memory"]["capacity_gb"] = "tiny", 1e-6
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["plan", "--model", "demo", "--hardware", str(path), "--tpot-slo", "100", "--devices", "4"]) == 2
    assert "no layout fits the devices' memory" in capsys.readouterr().err


def _profile(tmp_path: Path) -> Path:
    line = Linear(1e-5, 1e-4)
    cm = CostModel("profile test", "demo", "float32", LayerCosts(line, line, line, Linear(2e-6, 5e-5)), line, line,
                   Link(5e-5, 1e9))  # fmt: skip
    path = tmp_path / "profile.json"
    path.write_text(cm.to_json())
    return path


def test_plan_on_a_profile_writes_a_cpu_cluster(tmp_path, capsys):
    out_yaml = tmp_path / "plan.yaml"
    argv = ["plan", "--model", "demo", "--profile", str(_profile(tmp_path)), "--tpot-slo", "50", "--devices", "3"]
    assert main([*argv, "--output", str(out_yaml)]) == 0
    out = capsys.readouterr().out
    assert "memory per device not checked" in out
    assert all(r[1] == "1" for r in _rows(out))  # a profile is one TP size's
    cfg = load(str(out_yaml))
    assert cfg.nodes[0].device_type == "cpu" and len(cfg.processes) <= 3


def test_simulate_prints_the_step_of_a_cluster_yaml(tmp_path, capsys):
    argv = ["simulate", "deploy/1a2f.yaml", "--profile", str(_profile(tmp_path)), "--batch", "8"]
    assert main([*argv, "--micro-batches", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["source"] == "profile test" and out["step_time"] > 0 and out["devices"] == 3


def test_simulate_cautions_where_processes_outnumber_the_profiles_cores(tmp_path, capsys):
    """bench-plan under-predicted three processes on two cores (docs/benchmarks/planner.md): a layout like
    that on a profile's host says so; one with a core per process, or on a device, does not."""
    import dataclasses

    profile = tmp_path / "profile.json"
    cm = CostModel.from_json(_profile(tmp_path).read_text())
    for cores, cautioned in ((2, True), (3, False), (0, False)):
        profile.write_text(dataclasses.replace(cm, host_cores=cores).to_json())
        argv = ["simulate", "deploy/1a2f.yaml", "--profile", str(profile), "--batch", "8", "--micro-batches", "1"]
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert ("caution: 3 node processes on the host's 2 cores" in out) is cautioned, (cores, out)


def test_the_search_space_stays_within_the_devices():
    space = Space(6, tp_sizes=(1, 2))
    seen = list(space.layouts(max_ffn=16))
    assert seen and all(a * tp + f <= 6 for a, f, tp, *_ in seen)
    assert not any(r == "attention" and f == 1 for _, f, _, _, r, _ in seen)
    assert BATCHES[0] == 1 and tuple(sorted(BATCHES)) == BATCHES
    with pytest.raises(ValueError, match="at least 2"):
        Space(1)


def test_a_family_without_attention_tp_is_planned_at_tp_1(tmp_path, capsys):
    from hf_qwen3 import BASE

    (tmp_path / "config.json").write_text(json.dumps({**BASE, "model_type": "qwen3_moe"}))
    assert main(["plan", "--model", str(tmp_path), "--hardware", "h200", "--tpot-slo", "5", "--devices", "4"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows and {r[1] for r in rows} == {"1"}  # afd cuts MLA families only


@pytest.mark.slow  # starts the planned cluster: node processes, > 10 s
@pytest.mark.multiprocess
def test_a_plan_on_a_cpu_profile_launches_here_and_serves(tmp_path, capsys):
    """The acceptance check: the YAML `afd plan` writes from a CPU profile is one `afd launch` starts on this
    machine, and its API answers."""
    import os
    import sys

    from cluster_helpers import ROOT, post, stop_launcher

    from afd.cluster.processes import Command, NodeProcesses

    out_yaml = tmp_path / "plan.yaml"
    argv = ["plan", "--model", "demo", "--profile", str(_profile(tmp_path)), "--tpot-slo", "50", "--devices", "2"]
    assert main([*argv, "--output", str(out_yaml)]) == 0
    assert load(str(out_yaml)).topology_name == "1A1F"  # two devices: one of each
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    procs = NodeProcesses(str(tmp_path), cwd=ROOT)
    launcher = procs.start(Command("afd-launch", (sys.executable, "-m", "afd", "launch", str(out_yaml))), env=env)
    try:

        def urls() -> list[str]:
            return [ln for ln in procs.log("afd-launch").splitlines() if ln.startswith("http://")]

        procs.wait_until(urls, 120, "afd launch to print its URL")
        code, body = post(urls()[0], "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0})
        assert code == 200 and body["choices"][0]["finish_reason"] in ("length", "stop"), body
    finally:
        stop_launcher(launcher, procs)
