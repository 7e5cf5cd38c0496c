"""The metrics behind the dashboard move as they should, in process: the FFN node's compute + idle add
up to its loop's wall time, per layer; the cluster-state, micro-batch and engine-dead gauges; identity
experts counted where they are applied."""

from __future__ import annotations

import argparse
import queue
import time

import pytest
import torch
from cluster_helpers import wait_for
from metrics_text import samples, total

from afd.control import control_pb2 as pb
from afd.model.demo_config import DEMO_CONFIG
from afd.observability.attention_metrics import AttentionMetrics
from afd.observability.ffn_metrics import FFNMetrics


class _SlowPlane:
    """One attention peer's scripted step headers; every wait takes `wait_s`, as a peer still busy would."""

    generation = 0

    def add(self, peer, link) -> None:  # the server adopts the scripted peer's pair
        pass

    def drop(self, peer) -> None:
        pass

    def check(self) -> None:  # no deadline passes here
        pass

    def __init__(self, headers: list, wait_s: float):
        self.headers, self.wait_s = list(headers), wait_s

    def irecv(self, tensor, peer):
        if tensor.dtype == torch.int64:  # a step header (MoE inputs are float): the next one in the script
            tensor.copy_(self.headers.pop(0).encode())

    def isend(self, tensor, peer):
        pass

    def wait(self, work, peer, what):
        time.sleep(self.wait_s)


class _SlowFFN:
    """An FFN half whose every layer computes for `compute_s`."""

    def __init__(self, layers: int, compute_s: float):
        self.cfg = argparse.Namespace(hidden_size=4, num_layers=layers, moe_layers=tuple(range(layers)))
        self.layers = [
            argparse.Namespace(experts=argparse.Namespace(last_counts=[1, 0], last_zero=None)) for _ in range(layers)
        ]
        self.compute_s = compute_s

    def layer(self, i: int):
        return self.layers[i]

    def __call__(self, backend, layer, x):
        time.sleep(self.compute_s)
        return x.clone()


def test_ffn_compute_and_idle_add_up_to_the_serving_loop_wall_time():
    from afd.backend import get_backend
    from afd.dataplane.protocol import FLAG_IDLE, FLAG_LEAVE, StepHeader
    from ffn_node.peers import FormedPair
    from ffn_node.server import FFNServer, ServeEnd

    script = [
        StepHeader(0, (3, 2)),
        StepHeader(1, (1, 1)),
        StepHeader(2, (), FLAG_IDLE),
        StepHeader(2, (2,)),
        StepHeader(3, (), FLAG_LEAVE),
    ]
    metrics = FFNMetrics("ffn0", "m", range(2), num_layers=3)
    formed: queue.SimpleQueue = queue.SimpleQueue()
    formed.put([FormedPair(0, "attn0", None)])  # attn0's pair, formed: the server adopts it at its first step boundary
    server = FFNServer(
        _SlowFFN(3, 0.004), get_backend("cpu"), _SlowPlane(script, 0.002), formed, torch.float32, metrics=metrics
    )
    t0 = time.perf_counter()
    assert server.serve() is ServeEnd.LEFT
    wall = time.perf_counter() - t0
    got = samples(metrics.render().decode())
    compute, idle = total(got, "afd_ffn_compute_seconds_sum"), total(got, "afd_ffn_idle_seconds_sum")
    assert compute + idle == pytest.approx(wall, rel=0.02), "sends, bookkeeping and header waits are idle too"
    assert (compute, idle) == pytest.approx((server.timers.total("compute"), server.timers.total("idle")))
    layer_compute = {dict(k)["layer"]: v for k, v in got["afd_ffn_layer_compute_seconds_total"].items()}
    layer_idle = {dict(k)["layer"]: v for k, v in got["afd_ffn_layer_idle_seconds_total"].items()}
    assert sorted(layer_compute) == sorted(layer_idle) == ["0", "1", "2"]
    assert sum(layer_compute.values()) == pytest.approx(compute)
    assert all(v >= 5 * 0.004 for v in layer_compute.values())  # 5 micro-batches computed per layer
    assert all(v >= 5 * 0.002 for v in layer_idle.values())  # each waited for its inputs
    # The rest of idle is between steps: 5 header waits, an idle ack, each step's sends (15 in all).
    assert idle - sum(layer_idle.values()) >= 21 * 0.002


def test_cluster_state_gauge_reads_the_nodes_view_at_scrape_time():
    view = {"state": pb.ClusterStatus.READY}
    metrics = FFNMetrics("ffn0", "m", range(1), num_layers=1)
    metrics.watch_cluster_state(lambda: view["state"])
    assert total(metrics.render().decode(), "afd_cluster_state") == pb.ClusterStatus.READY
    view["state"] = pb.ClusterStatus.DEGRADED
    assert total(metrics.render().decode(), "afd_cluster_state") == pb.ClusterStatus.DEGRADED


def _demo_ffn(experts=None, serves_zero: bool = True):
    from afd.model.longcat_flash.ffn import FFNHalf
    from afd.model.registry import config_from_hf

    cfg = config_from_hf(DEMO_CONFIG)
    torch.manual_seed(0)
    ffn = FFNHalf(cfg, experts, serves_zero)
    for p in ffn.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return cfg, ffn


def test_zero_expert_tokens_count_identity_assignments():
    from afd.backend import get_backend

    cfg, ffn = _demo_ffn()
    metrics = FFNMetrics("ffn0", "m", range(cfg.n_routed_experts), cfg.num_layers)
    want, T = 0, 32
    with torch.inference_mode():
        for layer in range(cfg.num_layers):
            x = torch.randn(T, cfg.hidden_size)
            ffn(get_backend("cpu"), layer, x)
            metrics.add_routed(ffn.layers[layer].experts)
            want += int((ffn.layers[layer].router(x)[1] >= cfg.n_routed_experts).sum())
    got = samples(metrics.render().decode())
    assert total(got, "afd_zero_expert_tokens_total") == want > 0
    assert want + total(got, "afd_expert_tokens_total") == T * cfg.moe_topk * cfg.num_layers  # every slot
    # An FFN node that does not apply identity experts counts none: the cluster's sum is not doubled.
    _, other = _demo_ffn(range(0, 8), serves_zero=False)
    metrics = FFNMetrics("ffn1", "m", range(8), cfg.num_layers)
    with torch.inference_mode():
        other(get_backend("cpu"), 0, torch.randn(T, cfg.hidden_size))
    metrics.add_routed(other.layers[0].experts)
    assert total(metrics.render().decode(), "afd_zero_expert_tokens_total") == 0


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    import afd

    return afd.LLM(tiny_checkpoint)


def _job(llm, moe=None, micro_batches: int = 1):
    from hf_reference import PROMPTS

    engine = llm.job_engine(PROMPTS, [6] * len(PROMPTS), moe, micro_batches=micro_batches)
    engine.metrics = AttentionMetrics("attn0", "m")
    return engine, PROMPTS


def _add(engine, prompts) -> None:
    from afd.engine.request import Request
    from afd.engine.sampling import SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(Request(str(i), p, SamplingParams(), 6, lambda out: None))


def test_micro_batch_gauge_is_what_each_step_ran_with(llm):
    engine, prompts = _job(llm, micro_batches=0)  # 0: MicroBatchTuner decides
    tuner = engine.runner.tuner
    for _ in range(tuner.warmup):  # decode steps that waited half the time: the tuner tries a split next
        tuner.observe(1.0, 0.5, True, len(prompts))
    _add(engine, prompts)
    seen = []
    while engine.has_unfinished():
        chosen = engine.runner.micro_batches
        assert engine.step() is not None
        assert engine.metrics.micro_batches._value.get() == chosen
        seen.append(chosen)
    assert max(seen) > 1, "the tuner's split reached the gauge"


def test_engine_dead_gauge_is_set_when_the_engine_dies(llm):
    from afd.dataplane.exchange import LocalMoE
    from afd.dataplane.transport import PeerError

    class Gone(LocalMoE):
        def submit(self, layer, micro_batch, m):
            raise PeerError("rank 1 is gone", 1)

    engine, prompts = _job(llm, Gone(llm.ffn, llm.backend))
    dead = engine.metrics.engine_dead
    assert dead._value.get() == 0
    engine.start()
    try:
        _add(engine, prompts[:1])
        wait_for("afd_engine_dead == 1", lambda: dead._value.get() == 1, 10)
        assert engine.dead and "rank 1 is gone" in engine.dead
    finally:
        engine.stop()
