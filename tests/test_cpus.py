"""Usable CPUs from the affinity set and the cgroup CPU quota (afd/cluster/cpus.py), on fake cgroup files."""

from __future__ import annotations

from pathlib import Path

import pytest

from afd.cluster import cpus
from afd.cluster.topology import cpu_threads
from afd.config.loader import load

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def affinity(monkeypatch):
    """Pretend this process may run on `n` CPUs (the host may have any number)."""

    def set_to(n: int) -> None:
        monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)

    set_to(64)
    return set_to


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return root


@pytest.mark.parametrize(
    "cpu_max, limit",
    [
        ("max 100000", None),  # no limit
        ("150000 100000", 2),  # 1.5 CPUs: rounded up
        ("200000 100000", 2),
        ("50000 100000", 1),  # half a CPU: still one thread
        ("400000 50000", 8),  # a shorter period
        ("max", None),
        ("garbage", None),
    ],
)
def test_cgroup_v2_cpu_max(tmp_path, cpu_max, limit):
    assert cpus.cgroup_cpu_limit(write(tmp_path, {"cpu.max": cpu_max})) == limit


@pytest.mark.parametrize("directory", ["cpu", "cpu,cpuacct"])
def test_cgroup_v1_quota_and_period(tmp_path, directory):
    root = write(tmp_path, {f"{directory}/cpu.cfs_quota_us": "300000", f"{directory}/cpu.cfs_period_us": "100000"})
    assert cpus.cgroup_cpu_limit(root) == 3


def test_cgroup_v1_unlimited_is_no_limit(tmp_path):
    root = write(tmp_path, {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"})
    assert cpus.cgroup_cpu_limit(root) is None


def test_cgroup_v2_wins_over_v1(tmp_path):
    root = write(
        tmp_path, {"cpu.max": "100000 100000", "cpu/cpu.cfs_quota_us": "800000", "cpu/cpu.cfs_period_us": "100000"}
    )
    assert cpus.cgroup_cpu_limit(root) == 1


def test_no_cgroup_files_is_no_limit(tmp_path):
    assert cpus.cgroup_cpu_limit(tmp_path) is None


def test_usable_cpus_is_the_smaller_of_quota_and_affinity(tmp_path, affinity):
    root = write(tmp_path, {"cpu.max": "150000 100000"})
    assert cpus.usable_cpus(root) == 2  # the quota, not the 64 CPUs of the affinity set
    affinity(1)
    assert cpus.usable_cpus(root) == 1  # a CPU set narrower than the quota
    assert cpus.usable_cpus(tmp_path / "none") == 1


def test_usable_cpus_without_a_quota_is_the_affinity_set(tmp_path, affinity):
    affinity(3)
    assert cpus.usable_cpus(write(tmp_path, {"cpu.max": "max 100000"})) == 3


def test_usable_cpus_without_sched_getaffinity_falls_back_to_cpu_count(tmp_path, monkeypatch):
    monkeypatch.delattr(cpus.os, "sched_getaffinity", raising=False)  # as on macOS
    monkeypatch.setattr(cpus.os, "cpu_count", lambda: 12)
    assert cpus.usable_cpus(tmp_path) == 12
    assert cpus.usable_cpus(write(tmp_path, {"cpu.max": "400000 100000"})) == 4


def test_cpu_threads_split_the_usable_cpus_not_the_host(monkeypatch):
    """deploy/local.yaml: two CPU nodes on one host share what the container may use."""
    monkeypatch.setattr(cpus, "usable_cpus", lambda: 6)
    monkeypatch.setattr(cpus.os, "cpu_count", lambda: 128)
    cfg = load(str(ROOT / "deploy" / "local.yaml"))
    assert [cpu_threads(cfg, n.name) for n in cfg.nodes] == [3, 3]
