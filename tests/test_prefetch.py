"""Weight prefetch: the schedule, the backends' calls, and generation unchanged with it on."""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch
from cluster_helpers import Cluster, cluster_yaml, get, post
from hf_reference import PROMPTS

from afd.backend import Backend, get_backend
from afd.backend.npu import NpuBackend
from afd.dataplane.prefetch import PrefetchConfig, PrefetchSchedule
from afd.model.checkpoint import DummyReader, build_ffn_half
from afd.model.registry import load_config


class _Recorder(Backend):
    name, dist_backend = "rec", "gloo"
    device = torch.device("cpu")

    def __init__(self):
        self.calls = []

    def grouped_matmul(self, x, w, sizes):
        raise NotImplementedError

    def prefetch(self, weight, max_bytes):
        n = min(max_bytes, weight.numel() * weight.element_size())
        self.calls.append((weight, n))
        return n


@pytest.fixture(scope="module")
def ffn(tiny_checkpoint):
    cfg = load_config(tiny_checkpoint)
    return build_ffn_half(cfg, DummyReader(0), torch.float32, torch.device("cpu"))


def test_schedule_hints_this_layer_then_the_next_within_budget(ffn):
    be = _Recorder()
    sched = PrefetchSchedule(ffn, be, PrefetchConfig(True, budget_bytes=1 << 30))
    first = sched(0)
    l0, l1 = ffn.layers[0], ffn.layers[1]
    assert [w for w, _ in be.calls] == [
        l0.router.classifier.weight,
        l0.experts.w13,
        l0.experts.w2,
        l1.router.classifier.weight,
        l1.experts.w13,
    ]
    assert first == sum(n for _, n in be.calls) and sched.bytes_total == first
    assert sched(0) == first  # every wait hints again: the caches may have lost the lines since
    be.calls.clear()
    router_bytes = l0.router.classifier.weight.numel() * 4
    budget = router_bytes + 100
    small = PrefetchSchedule(ffn, be, PrefetchConfig(True, budget_bytes=budget, weights=("router", "gate_up")))
    assert small(1) == budget
    assert [n for _, n in be.calls] == [router_bytes, 100]  # the last layer has no next layer


def test_bad_prefetch_config():
    with pytest.raises(ValueError, match="unknown"):
        PrefetchConfig(weights=("attention",))
    with pytest.raises(ValueError, match="positive"):
        PrefetchConfig(budget_bytes=0)


def test_cpu_prefetch_reads_and_reports_bytes():
    w = torch.randn(1000, 64)
    be = get_backend("cpu")
    assert be.prefetch(w, 4096) == 4096 and be.prefetch(w, 1 << 30) == w.numel() * 4
    assert not be.prefetch_by_default  # docs/benchmarks.md: no clear gain on CPU


def test_npu_prefetch_calls_torch_npu_through_the_backend(monkeypatch):
    calls = []
    fake = types.SimpleNamespace(npu_prefetch=lambda *a: calls.append(a))
    be = object.__new__(NpuBackend)  # no device here: skip __init__, keep the real method
    be._torch_npu = fake
    w = torch.zeros(256)
    dep = torch.ones(1)
    assert be.prefetch(w, 512, dep) == 512 and be.prefetch(w, 1 << 20) == 1024
    assert calls[0][0] is w and calls[0][1] is dep and calls[0][2] == 512
    assert calls[1][1] is w and calls[1][2] == 1024  # graph mode refuses no dependency: the weight orders it
    assert NpuBackend.prefetch_by_default


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is None, reason="torch_npu not installed (no Ascend NPU)")
def test_npu_prefetch_for_real():
    be = get_backend("npu")
    w = torch.randn(1024, 1024, device=be.device)
    assert be.prefetch(w, 1 << 20) == 1 << 20
    be.synchronize()


@pytest.mark.slow  # CI runs it in make test-slow; a default case covers the same path
@pytest.mark.multiprocess
def test_generation_unchanged_with_prefetch_on(families, tiny_checkpoint, tmp_path):
    ref = families.ref_ids("longcat_flash", "zero_experts", 12)  # tiny_checkpoint's
    path = cluster_yaml(tmp_path, tiny_checkpoint, name="prefetch", prefetch={"enabled": True, "budget_bytes": "64KiB"})
    with Cluster(path) as c:
        c.start_all()
        c.wait_ready()
        for p, want in zip(PROMPTS, ref):
            code, body = post(
                c.url(), "/v1/completions", {"prompt": p, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
            )
            assert code == 200 and body["choices"][0]["token_ids"] == want
        ffn_metrics = get(f"http://127.0.0.1:{c.node('ffn0')['ports']['metrics']}", "/metrics")[1].decode()
    hinted = [ln for ln in ffn_metrics.splitlines() if ln.startswith("afd_prefetch_bytes_total")]
    assert float(hinted[0].split()[-1]) > 0
    assert "weight prefetch: on" in c.log("ffn0")
