"""`--hardware cpu`: this CPU's spec is measured, not looked up, written where load_spec("cpu") finds
it with every figure's source saying what measured it, and plans like a shipped spec; before any `afd profile`
it is refused with what to run."""

from __future__ import annotations

import pytest

from afd.entrypoints.cli import main
from afd.plan.costs import Link
from afd.plan.cpu_hardware import measure, write
from afd.plan.hardware import SpecError, cpu_spec_path, load_spec


def test_the_cpu_spec_is_measured_written_and_planned_with(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AFD_CACHE_DIR", str(tmp_path))
    with pytest.raises(SpecError, match="afd profile FILE"):
        load_spec("cpu")
    d = measure(link=Link(5e-5, 2e9))  # the profile's link, as `afd profile` hands it over
    assert write(d) == cpu_spec_path() and cpu_spec_path().is_relative_to(tmp_path)
    spec = load_spec("cpu")
    assert spec.name == "cpu" and spec.flops("fp32") > 0 and spec.flops("bf16") > 0
    assert spec.memory_bandwidth > 0 and spec.memory_capacity > 1e9 and spec.launch_overhead > 0
    assert spec.inter_node.bandwidth == pytest.approx(2e9) and spec.inter_node.latency == pytest.approx(5e-5)
    assert all("measured by afd profile on" in src for _, src in spec.sources)
    # the demo serves in float32 on a CPU, and the measured spec has the fp32 peak to cost it with
    assert main(["plan", "--model", "demo", "--hardware", "cpu", "--tpot-slo", "500", "--devices", "3"]) == 0
    out = capsys.readouterr().out
    assert "costed in bfloat16" not in out and "hardware cpu" in out
