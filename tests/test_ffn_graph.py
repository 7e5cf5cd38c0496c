"""The FFN half in graph mode (afd/model/ffn_graph.py): token buckets, padding and slicing, counts over the
real rows, and the layers as torchair graphs on the fake (tests/fakes/torchair), one per (layer, bucket).

On CPU the FFN half stays eager (its grouped GEMM reads group sizes on the host), so the wrapper's own logic
is held here with a compile stub that runs each graph's function as it is and counts the graphs."""

from __future__ import annotations

import logging

import pytest
import torch
from cluster_helpers import Cluster, cluster_yaml, get, post
from hf_reference import PROMPTS
from metrics_text import total
from npu_fake import check_one_host_sync_per_step, on_devices, reports, snapshot, sync_env
from test_metrics_in_process import _demo_ffn
from test_npu_fakes import _fresh, _npu_backend, ops, torchair  # noqa: F401  (_fresh, torchair: fixtures)

import afd
from afd.backend.cpu import CpuBackend
from afd.dataplane.exchange import LocalMoE
from afd.engine import offline
from afd.engine.sampling import SamplingParams
from afd.model.ffn_graph import FFNGraph, token_buckets, wrap
from afd.model.registry import load_config

N = 7


class _Stub(CpuBackend):
    """A backend whose "graphs" are the functions as they are (CPU's GEMMs read the sizes on the host, which is
    fine outside a graph), built lazily: the wrapper's logic without a compiler."""

    group_sizes_on_host = False

    def __init__(self):
        self.compiled: list[str] = []

    def compile(self, fn, cache_dir=None):
        self.compiled.append(fn.__name__)
        return fn


def test_token_buckets_cover_every_peer_s_largest_micro_batch():
    assert token_buckets((8, 2, 2, 1), 1) == [1, 2, 8]
    assert token_buckets((1, 2, 4), 3) == [1, 2, 4, 8, 16]  # 3 peers x 4 rows fit 16
    assert token_buckets((4,), 2) == [4, 8]


def test_padded_rows_change_neither_outputs_nor_counts():
    cfg, ffn = _demo_ffn()
    be = _Stub()
    graph = FFNGraph(ffn, be, [4, 8])
    torch.manual_seed(1)
    with torch.inference_mode():
        for layer in range(cfg.num_layers):
            for T in (3, 4, 8, 11):  # 11: above the largest bucket, eager
                x = torch.randn(T, cfg.hidden_size)
                y = graph(be, layer, x)
                ex = ffn.layer(layer).experts
                counts, zero = ex.last_counts.clone(), ex.last_zero.clone()
                want = ffn(be, layer, x)
                assert y.shape == (T, cfg.hidden_size)
                torch.testing.assert_close(y, want)
                assert torch.equal(counts, ex.last_counts) and int(zero) == int(ex.last_zero), (layer, T)
    # one graph per (layer, bucket), each with a code object of its own; 11 tokens ran eager
    assert sorted(be.compiled) == sorted(f"ffn_l{i}_t{P}_{graph._tag}" for i in range(cfg.num_layers) for P in (4, 8))
    assert graph.passes == {"graph": 3 * cfg.num_layers, "eager": cfg.num_layers}
    assert graph.cfg is ffn.cfg and graph.layer(0) is ffn.layer(0)  # the half's interface passes through


def test_warm_up_builds_every_graph_and_then_compiles_none(caplog):
    cfg, ffn = _demo_ffn()
    be = _Stub()
    graph = FFNGraph(ffn, be, [2, 4])
    graph.warm_up()
    assert graph.warmup_graphs == len(be.compiled) == 2 * cfg.num_layers and graph.passes["graph"] == 0
    graph.buckets.append(8)  # a bucket warm-up left out: eager, said once, no compile mid-step
    with torch.inference_mode(), caplog.at_level(logging.WARNING, "afd.graph"):
        graph(be, 0, torch.randn(7, cfg.hidden_size))
        graph(be, 0, torch.randn(7, cfg.hidden_size))
    assert len(be.compiled) == 2 * cfg.num_layers and graph.passes == {"graph": 0, "eager": 2}
    assert caplog.text.count("was not built at warm-up") == 1


def test_cpu_keeps_the_ffn_half_eager(caplog):
    _, ffn = _demo_ffn()
    with caplog.at_level(logging.INFO, "afd.graph"):
        assert wrap(ffn, CpuBackend(), "compile", (4,), 1) is ffn
    assert "reads group sizes on the host" in caplog.text
    assert wrap(ffn, _Stub(), None, (4,), 1) is ffn  # the backend's default: eager


def test_ffn_layers_as_torchair_graphs_one_per_bucket_equal_hf(tiny_checkpoint, families, torchair, monkeypatch):  # noqa: F811
    prompts, per = PROMPTS, [N] * len(PROMPTS)  # decode: 4 rows, the 4-token bucket; prefill eager
    llm = afd.LLM(tiny_checkpoint, block_size=16)
    be = _npu_backend()
    graph = wrap(llm.ffn, be, "compile", (2, 4), 1)  # fake torchair, CPU tensors; warm-up: NpuBackend's rule
    assert isinstance(graph, FFNGraph) and graph.warmed_up
    layers = llm.ffn.cfg.moe_layers
    assert graph.warmup_graphs == 2 * len(layers) and sorted(graph._fns) == [(i, P) for i in layers for P in (2, 4)]
    monkeypatch.setattr(afd.backend, "get_backend", lambda *a: be)
    engine = llm.job_engine(prompts, per, moe=LocalMoE(graph, be), graph_mode="eager")  # the FFN half alone
    out = offline.generate(engine, prompts, per, SamplingParams(), ignore_eos=True)
    assert out == families.ref_ids("longcat_flash", "zero_experts", N)  # HF's greedy tokens
    # every decode step's layers ran in graphs (N - 1 steps), the prefill eager; nothing compiled after warm-up
    assert graph.passes == {"graph": (N - 1) * len(layers), "eager": len(layers)}
    assert len(graph._fns) == 2 * len(layers) and all(fn is not None for fn in graph._fns.values())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_1a1f_on_the_fake_npu_runs_the_ffn_half_in_torchair_graphs(tiny_checkpoint, families, tmp_path):
    """graph_mode: compile on the fake Ascend device, HCCL played by gloo: the FFN node builds its (layer,
    bucket) graphs at start-up, before the data plane forms; HF's tokens; one host sync per step on each node.
    The fake device's tensors (a Python tensor subclass) are not traceable by dynamo, so there every graph
    of either half fails its compile and runs eager, said once: this holds the wrapper's fallback inside a
    real cluster; the graphs themselves are held on the fake torchair above, over CPU tensors."""
    path = cluster_yaml(
        tmp_path,
        tiny_checkpoint,
        name="npu",
        layout={"micro_batches": 1, "graph_mode": "compile"},
        engine={"graph_batch_sizes": [2, 4]},
    )
    on_devices(path)
    report = tmp_path / "fake-npu"
    with Cluster(path, env=sync_env(report)) as c:
        c.start_all()
        c.wait_ready(timeout=180)
        ref = families.ref_ids("longcat_flash", "zero_experts", N)
        for prompt, want in zip(PROMPTS, ref):
            body = {"prompt": prompt, "max_tokens": N, "temperature": 0, "return_token_ids": True}
            code, out = post(c.url("attn0"), "/v1/completions", body)
            assert code == 200 and out["choices"][0]["token_ids"] == want, out
        layers = len(load_config(tiny_checkpoint).moe_layers)
        log = c.log("ffn0")
        assert log.index("FFN warm-up built") < log.index("data plane up"), log  # before any peer waits on it
        assert log.count("tokens does not compile") == 2 * layers, log  # each (layer, bucket) tried once
        text = get(f"http://127.0.0.1:{c.node('ffn0')['ports']['metrics']}", "/metrics")[1].decode()
        passes = {m: total(text, "afd_ffn_layer_passes_total", mode=m) for m in ("graph", "eager")}
        assert passes == {"graph": 0, "eager": len(PROMPTS) * N * layers}, passes  # prefill + N - 1 decode steps
        check_one_host_sync_per_step(c.url("attn0"), snapshot(report, c), {"attn0": "attention", "ffn0": "ffn"})
    for r in reports(report).values():
        assert r["device"]["hazards"] == [] and r["device"]["unbound"] == []


def test_the_ffn_half_stays_eager_where_the_grouped_gemm_reads_its_sizes(caplog):
    be = _npu_backend()  # npu_grouped_matmul's limits: beyond them grouped_matmul reads the sizes on the host
    assert be.grouped_matmul_in_graph(torch.empty(8, 64, 32)) and be.grouped_matmul_in_graph(torch.empty(1, 8, 8))
    assert not be.grouped_matmul_in_graph(torch.empty(1025, 8, 8))
    assert not be.grouped_matmul_in_graph(torch.empty(4, 65536, 8))
    _, ffn = _demo_ffn()
    with caplog.at_level(logging.INFO, "afd.graph"):
        assert wrap(ffn, _Stub(), "compile", (4,), 1) is not ffn
        stub = _Stub()
        stub.grouped_matmul_in_graph = lambda w: w.shape[-1] != ffn.cfg.hidden_size  # w2 would read them
        assert wrap(ffn, stub, "compile", (4,), 1) is ffn
    assert caplog.text.count("reads group sizes on the host") == 1
