"""`afd profile` (afd.plan.profile*): the step split and the fits on synthetic measurements, the flags, the
attention TP a cost model holds at, FFN metrics ports on a local cluster, and one real profile of the demo
at 1A1F (the attention side timed inside the attention node)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os

import pytest

from afd.errors import UserError
from afd.plan.costs import CostModel
from afd.plan.profile import _sizes, add_parser, profile
from afd.plan.profile_check import ffn_counters
from afd.plan.profile_fit import (
    Measurements,
    cost_model,
    fit_link,
    predicted_cluster_step,
    profile_json,
    steps_table,
    table,
)
from afd.plan.profile_link import LinkSample
from afd.plan.profile_measure import StepSample, median_sample, node_samples, split_steps
from afd.plan.shape import Layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _synthetic(batches=(1, 2, 4, 8, 16, 32), k=4) -> Measurements:
    """Pieces on known lines (seconds): pre 10us/token + 300us, window 50us/token + 500us, combine 1us,
    FFN 8us/row + 200us, overhead 20us/seq + 400us; link 50us + bytes / 4 GB/s."""
    steps = [
        StepSample(b, 10e-6 * b + 300e-6, 50e-6 * b + 500e-6, 1e-6, 8e-6 * b * k + 200e-6, 0.0, 0.0, 20e-6 * b + 400e-6)
        for b in batches
    ]
    link = [LinkSample(n, 50e-6 + n / 4e9) for n in (64, 1024, 65536, 1 << 20)]
    return Measurements("x.yaml", "demo", "float32", 64, k, steps, link, moe_layers=4, bytes_per_token=(1024, 1024))


def test_fits_recover_synthetic_lines():
    model = cost_model(_synthetic())
    layer = model.moe_layer
    assert layer.attn_pre.slope == pytest.approx(10e-6) and layer.attn_pre.intercept == pytest.approx(300e-6)
    assert layer.attn_window.slope == pytest.approx(50e-6) and layer.attn_window.intercept == pytest.approx(500e-6)
    assert layer.attn_post.slope == pytest.approx(0.0, abs=1e-12) and layer.attn_post.intercept == pytest.approx(1e-6)
    assert layer.ffn.slope == pytest.approx(8e-6) and layer.ffn.intercept == pytest.approx(200e-6)
    assert model.step_overhead.slope == pytest.approx(20e-6) and model.step_overhead.points == 6
    assert model.dense_layer.points == 0 and model.dense_layer(8) == 0.0  # no dense layer measured
    assert model.link.latency == pytest.approx(50e-6) and model.link.bandwidth == pytest.approx(4e9, rel=1e-6)
    assert layer.ffn.rel_err == pytest.approx(0.0, abs=1e-9)
    assert model.source == "profile x.yaml" and any("context 64" in n for n in model.notes)


def test_submit_is_the_exchange_piece_per_routing():
    """With the cluster, each MoE layer's submit (the node's `moe` piece, less its share of the wait without
    overlap) is fitted under routing ffn, and under routing attention from the second run."""
    m = _synthetic()
    assert cost_model(m).submit(8) == 0.0  # in process the exchange is a call: nothing is posted
    steps = [dataclasses.replace(s, moe=5e-6 * s.batch + 100e-6, wait=4 * 1e-3) for s in m.steps]
    routed = [dataclasses.replace(s, moe=9e-6 * s.batch + 300e-6) for s in m.steps]
    cluster = [{"batch": s.batch, "step": s.step, "wait_fraction": 0.0} for s in m.steps]
    on = dataclasses.replace(m, steps=steps, dispatch_steps=routed, cluster=cluster)
    model = cost_model(on)
    assert model.submit.slope == pytest.approx(5e-6) and model.submit.intercept == pytest.approx(100e-6)
    assert model.submit_dispatch.slope == pytest.approx(9e-6) and model.submit_dispatch.intercept == pytest.approx(
        300e-6
    )
    held = [dataclasses.replace(s, moe=s.moe + 1e-3) for s in steps]  # without overlap: + the step's wait / 4 layers
    assert cost_model(dataclasses.replace(on, steps=held, overlap=False)).submit.intercept == pytest.approx(100e-6)


def test_ffn_message_is_the_round_trip_beyond_link_and_compute():
    """Without overlap each MoE layer's wait is a whole round trip: what it holds beyond the link both ways and
    the FFN fit at the node's rows is the FFN node's time per message (its loop, the receive's handling)."""
    m = dataclasses.replace(_synthetic(), overlap=False)
    model = cost_model(m)
    extra = 300e-6
    link, ffn = model.link, model.moe_layer.ffn
    cluster, steps = [], []
    for s in m.steps:
        rows = s.batch * m.experts_per_token
        trip = link(s.batch * 1024) + ffn(rows) + link(s.batch * 1024)
        steps.append(dataclasses.replace(s, wait=4 * (trip + extra)))
        cluster.append(
            {"batch": s.batch, "step": s.step, "wait_fraction": 0.5, "ffn_rows": rows, "ffn_seconds": ffn(rows)}
        )
    on = dataclasses.replace(m, steps=steps, cluster=cluster)
    assert cost_model(on).ffn_message == pytest.approx(extra, rel=1e-6)
    assert cost_model(on).ffn_message_dispatch == 0.0  # no cluster under routing attention
    assert cost_model(dataclasses.replace(on, overlap=True)).ffn_message == 0.0  # the wait is then a remainder
    # the cluster routed on the attention side: its wait also holds the count message before the rows
    routed = [dataclasses.replace(s, wait=s.wait + 4 * (link(8) + 2 * extra)) for s in steps]
    model = cost_model(dataclasses.replace(on, dispatch_steps=routed))
    assert model.ffn_message == pytest.approx(extra, rel=1e-6)
    assert model.ffn_message_dispatch == pytest.approx(3 * extra, rel=1e-6)


def test_measurements_round_trip_so_a_stored_profile_refits():
    from afd.plan.profile_fit import measurements_of

    m = dataclasses.replace(_synthetic(), dispatch_steps=_synthetic().steps[:2], notes=("a",), host_cores=2)
    back = measurements_of(json.loads(profile_json(cost_model(m), m)))
    assert back == m and cost_model(back) == cost_model(m)
    assert measurements_of({"measurements": {"steps": []}}) is None  # written before they were whole
    # the nodes ran on this CPU, so over gloo, whose sends wait for their receives; in process: no data plane
    assert cost_model(m).rendezvous and not cost_model(dataclasses.replace(m, host_cores=0)).rendezvous


def test_json_round_trips_with_measurements():
    m = _synthetic()
    model = cost_model(m)
    text = profile_json(model, m)
    assert CostModel.from_json(text) == model
    d = json.loads(text)
    assert [s["batch"] for s in d["measurements"]["steps"]] == [1, 2, 4, 8, 16, 32]
    assert d["measurements"]["link"][0] == {"nbytes": 64, "seconds": pytest.approx(50e-6 + 64 / 4e9), "fastest": 0.0}
    lines = table(model).splitlines()
    assert len(lines) == 2 + 8 + 1 and "link" in lines[-1] and "4.00 GB/s" in lines[-1]
    assert len(steps_table(m, model).splitlines()) == 2 + 6
    checked = Measurements(**{**m.__dict__, "cluster": [{"batch": 1, "step": 2e-3, "wait_fraction": 0.25}]})
    rows = steps_table(checked, model).splitlines()
    assert rows[0].count("|") == 6 and "attention node 0" in rows[0] and "| 25% |" in rows[2]
    assert rows[3].count("|") == 4


def test_noisy_fit_keeps_its_error_and_no_negative_coefficient():
    m = _synthetic(batches=(1, 2, 4))
    noisy = [StepSample(s.batch, s.pre * (1.3 if s.batch == 2 else 1.0), *[getattr(s, f) for f in
             ("window", "combine", "moe", "dense", "step", "overhead")]) for s in m.steps]  # fmt: skip
    model = cost_model(Measurements(**{**m.__dict__, "steps": noisy}))
    assert model.moe_layer.attn_pre.rel_err > 0.05
    # a link whose time falls with size (noise) fits a flat line: bandwidth capped, not infinite or negative
    flat = fit_link([LinkSample(64, 2e-4), LinkSample(1 << 20, 1e-4)])
    assert flat.latency > 0 and math.isfinite(flat.bandwidth) and flat.bandwidth > 0


def test_ffn_fit_prefers_the_ffn_nodes_counters():
    m = _synthetic(batches=(1, 2, 4))
    cluster = [{"batch": b, "step": 1e-3, "wait_fraction": 0.1, "ffn_rows": 3.0 * b, "ffn_seconds": 9e-6 * 3 * b + 1e-4}
               for b in (1, 2, 4)]  # fmt: skip
    model = cost_model(Measurements(**{**m.__dict__, "cluster": cluster}))
    assert model.moe_layer.ffn.slope == pytest.approx(9e-6) and model.moe_layer.ffn.intercept == pytest.approx(1e-4)
    assert any("FFN node's compute" in n for n in model.notes)
    text = (
        "# TYPE afd_ffn_layer_compute_seconds_total counter\n"
        'afd_ffn_layer_compute_seconds_total{layer="0"} 0.5\nafd_ffn_layer_compute_seconds_total{layer="1"} 0.25\n'
        "# TYPE afd_ffn_tokens_total counter\nafd_ffn_tokens_total 40.0\n"
        "# TYPE afd_expert_tokens_total counter\n"
        'afd_expert_tokens_total{expert="0"} 100.0\nafd_expert_tokens_total{expert="3"} 20.0\n'
    )
    assert ffn_counters(text) == {"compute": 0.75, "tokens": 40.0, "rows": 120.0}


def test_split_steps_per_layer_and_overhead():
    # prefill (8 tokens), then 3 decode steps of 2 tokens; 2 MoE layers, 1 dense layer, 1 warm-up step skipped
    samples: list = []
    marks = [(1.0, 0, 8, 0.5, 0.0)]
    for step in range(3):
        samples += [("pre", 0, 2, 0.1), ("moe", 0, 2, 0.2), ("window", 0, 2, 0.3), ("combine", 0, 2, 0.01)]
        samples += [("pre", 1, 2, 0.1), ("moe", 1, 2, 0.2), ("window", 1, 2, 0.3), ("combine", 1, 2, 0.01)]
        samples += [("dense", 2, 2, 0.05), ("dense", 2, 2, 0.05)]
        marks.append((2.0 + 2 * step, len(samples), 2, 1.5, 0.125))
    out = split_steps(samples, marks, batch=2, moe_layers=2, dense_layers=1, warmup=1)
    assert len(out) == 2
    s = out[0]
    assert (s.pre, s.moe, s.window, s.combine, s.dense) == pytest.approx((0.1, 0.2, 0.3, 0.01, 0.1))
    # the wait on the FFN node (ffn_wait) lies outside every piece under overlap, inside `moe` without it
    assert s.step == pytest.approx(2.0) and s.overhead == pytest.approx(2.0 - 2 * 0.61 - 0.1 - 0.125)
    assert s.execute == 1.5 and s.wait == 0.125 and median_sample(out) == s
    inside = split_steps(samples, marks, batch=2, moe_layers=2, dense_layers=1, warmup=1, wait_in_moe=True)
    assert inside[0].overhead == pytest.approx(2.0 - 2 * 0.61 - 0.1)
    with pytest.raises(ValueError, match="no decode step"):
        median_sample([])
    # an attention node's job result (attention_node/worker.py with layer_times): the same split, from JSON
    steps = [{"tokens": t, "seconds": e, "ffn_wait": w} for _, _, t, e, w in marks]
    result = {"steps": steps, "layer_times": {"samples": [list(x) for x in samples], "marks": [m[:2] for m in marks]}}
    assert node_samples(result, 2, 2, 1, overlap=True) == out[1:]  # 2 warm-up steps there
    assert node_samples(result, 2, 2, 1, overlap=False)[0].overhead == pytest.approx(inside[0].overhead)
    with pytest.raises(ValueError, match="no layer times"):
        node_samples({"steps": steps, "layer_times": None}, 2, 2, 1, overlap=True)


def test_predicted_cluster_step_swaps_the_exchange_for_the_fitted_one():
    m = _synthetic(batches=(1, 2))
    model = cost_model(m)  # FFN 8us/row + 200us; link 50us + bytes / 4 GB/s
    link, ffn = model.link, model.moe_layer.ffn
    # the node's step: 4 MoE layers, each submit 10us, 1ms of wait per step under overlap
    s = StepSample(2, 1e-4, 5e-4, 0.0, 1e-5, 0.0, 0.0, 0.0, execute=5e-3, wait=1e-3)
    rt = 2 * link(2 * 1024) + ffn(6)  # round trip at 6 rows: 2 x (50us + 2KiB / 4GB/s) + 248us, under the window?
    hidden = predicted_cluster_step(m, s, model, rows=6)
    assert hidden == pytest.approx(5e-3 - 4 * 1e-5 - 1e-3 + 4 * max(0.0, rt - 5e-4))
    exposed = predicted_cluster_step(Measurements(**{**m.__dict__, "overlap": False}), s, model, rows=6)
    assert exposed == pytest.approx(5e-3 - 4 * 1e-5 + 4 * rt)  # without overlap the submit holds the wait


def test_cost_model_keeps_its_attention_tp(tmp_path):
    """The TP the attention side was measured at: in the profile's JSON, read back (1 when absent: a file
    from before the field), in a roofline's cost model, and the only TP `afd plan` searches on a profile."""
    from argparse import Namespace

    from afd.entrypoints.plan import _Source
    from afd.model.registry import config_from_hf
    from afd.plan.hardware import load_spec
    from afd.plan.roofline import roofline

    m = _synthetic(batches=(1, 2))
    model = cost_model(Measurements(**{**m.__dict__, "attention_tp": 2}))
    assert model.attention_tp == 2 and cost_model(m).attention_tp == 1
    text = profile_json(model, m)
    assert json.loads(text)["attention_tp"] == 2 and CostModel.from_json(text) == model
    old = json.loads(text)
    del old["attention_tp"]
    assert CostModel.from_json(json.dumps(old)).attention_tp == 1
    cfg = config_from_hf({"model_type": "deepseek_v3"})
    assert roofline(load_spec("h200"), cfg, context=0, attn_tp=4).cost_model().attention_tp == 4
    assert roofline(load_spec("h200"), cfg, context=0).cost_model().attention_tp == 1
    path = tmp_path / "profile.json"
    path.write_text(text)
    src = _Source(Namespace(hardware=None, profile=str(path)), cfg, "demo", "float32")
    assert src.tp_sizes() == (2,) and src.costs(Layout(1, 1, 8, attention_tp=2)) == model
    with pytest.raises(UserError, match="measured at attention_tp 2"):
        src.costs(Layout(1, 1, 8))


def test_ffn_metrics_gives_ffn_nodes_a_metrics_port():
    """LocalCluster's ffn_metrics: every FFN node of the local cluster's YAML gets a free metrics port (off by
    default), and LocalCluster.metrics_urls names them."""
    from afd.cluster.local import LocalCluster
    from afd.cluster.local_config import local_job, with_free_ports

    job = local_job("demo", 1, 2)
    assert all("metrics" not in n["ports"] for n in with_free_ports(job).to_dict()["nodes"])
    doc = with_free_ports(job, ffn_metrics=True).to_dict()
    ffn = [n for n in doc["nodes"] if n["role"] == "ffn"]
    assert len(ffn) == 2 and all(n["ports"]["metrics"] for n in ffn)
    ports = [p for n in doc["nodes"] for p in n["ports"].values()]
    assert len(ports) == len(set(ports))
    cluster = LocalCluster(job, ffn_metrics=True)
    cluster.processes.start_all = lambda commands: None  # no node processes: the YAML is what is checked
    try:
        assert cluster.metrics_urls == {}
        cluster.start()
        urls = cluster.metrics_urls
    finally:
        cluster.stop()
    assert sorted(urls) == ["ffn0", "ffn1"] and all(u.startswith("http://127.0.0.1:") for u in urls.values())


def test_flags():
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    args = p.parse_args(["profile", "deploy/local.yaml", "--batch-sizes", "4,1,2,2"])
    assert args.batch_sizes == (1, 2, 4) and args.output == "profile.json" and args.repeats == 2
    assert p.parse_args(["profile", "x.yaml"]).batch_sizes == (1, 2, 4, 8, 16, 32)
    for bad in ("1", "0,2", "a,b"):
        with pytest.raises(argparse.ArgumentTypeError):
            _sizes(bad)
    with pytest.raises(SystemExit):
        p.parse_args(["profile", "x.yaml", "--repeats", "0"])


def test_runner_timing_is_opt_in_and_changes_no_token():
    """ModelRunner.layer_times: None by default; set, it records every piece of every MoE layer per
    micro-batch and the tokens are the same as untimed."""
    from afd.engine import offline
    from afd.engine.sampling import SamplingParams
    from afd.entrypoints.llm import LLM
    from afd.observability.timing import LayerTimes

    llm = LLM("demo")
    prompts, per = [[5, 6, 7, 8], [9, 10, 11]], [4, 4]
    outs = []
    for timed in (False, True):
        engine = llm.job_engine(prompts, per, micro_batches=2)
        assert engine.runner.layer_times is None
        times = LayerTimes() if timed else None
        engine.runner.layer_times = times
        outs.append(offline.generate(engine, prompts, per, SamplingParams(), ignore_eos=True))
    assert outs[0] == outs[1]
    assert times is not None
    L = llm.cfg.num_layers
    steps = 4  # the prefill and 3 decode steps, 2 micro-batches each
    for piece in ("pre", "moe", "window", "combine"):
        assert sum(1 for p, *_ in times.samples if p == piece) == steps * 2 * L
    assert all(seconds >= 0 for *_, seconds in times.samples)


def _profile_demo(cluster: bool):
    return profile(
        os.path.join(ROOT, "deploy", "local.yaml"),
        (1, 2, 4),
        context=16,
        steps=3,
        repeats=1,
        link_repeats=5,
        cluster=cluster,
        link_sizes=(64, 4096, 262144),
        log=lambda _: None,
    )


def test_profile_demo(tmp_path):
    """The demo, a tiny sweep, without the cluster check: every fit finite and non-negative, errors kept, the
    file loads, and the runner timed every MoE piece."""
    m, model = _profile_demo(cluster=False)
    lines = [model.moe_layer.attn_pre, model.moe_layer.attn_window, model.moe_layer.attn_post, model.moe_layer.ffn]
    for f in [*lines, model.step_overhead]:
        assert f.points == 3 and math.isfinite(f.slope) and math.isfinite(f.intercept) and math.isfinite(f.rel_err)
        assert f.slope >= 0 and f.intercept >= 0 and f.rel_err >= 0 and f(4) > 0
    assert model.link.latency > 0 and 0 < model.link.bandwidth < float("inf") and model.link.rel_err >= 0
    assert all(0 < s.fastest <= s.seconds for s in m.link)
    assert all(s.pre > 0 and s.window > 0 and s.moe > 0 and s.execute > 0 for s in m.steps) and m.cluster == []
    assert m.moe_layers == 4 and m.bytes_per_token == (256 * 4, 256 * 4)  # the demo: hidden 256, float32
    assert model.host_cores == 0 and model.message_cpu == 0.0 and model.submit(4) == 0.0  # nothing crossed
    out = tmp_path / "profile.json"
    out.write_text(profile_json(model, m))
    assert CostModel.from_json(out.read_text()) == model


@pytest.mark.slow
def test_profile_demo_1a1f_cluster_check():
    """With the cluster: the demo's nodes at 1A1F ran each batch size, the attention side's pieces came from
    attention node 0's own runner (its job asked for layer_times), the FFN fit from the FFN node's counters,
    and the prediction from the fitted exchange is finite."""
    m, model = _profile_demo(cluster=True)
    assert [c["batch"] for c in m.cluster] == [1, 2, 4] and all(c["step"] > 0 for c in m.cluster)
    assert all(0 <= c["wait_fraction"] <= 1 for c in m.cluster)
    # the node's pieces: the same decode steps as its step reports, with its wait on the FFN node (0 in process)
    for s, c in zip(m.steps, m.cluster):
        assert s.batch == c["batch"] and s.execute == pytest.approx(c["step"])
        assert s.pre > 0 and s.window > 0 and s.combine > 0 and s.moe > 0 and s.step >= s.execute
    assert any(s.wait > 0 for s in m.steps)
    assert any("attention node 0" in n for n in model.notes) and model.attention_tp == 1
    lines = [model.moe_layer.attn_pre, model.moe_layer.attn_window, model.moe_layer.attn_post, model.step_overhead]
    assert all(f.points == 3 and math.isfinite(f.slope) and f(4) > 0 for f in lines)
    # the FFN node's own counters: routed rows per pass between 0 and batch x top-k (identity slots stay out)
    assert all(0 < c["ffn_rows"] <= c["batch"] * m.experts_per_token and c["ffn_seconds"] > 0 for c in m.cluster)
    assert model.moe_layer.ffn.points == 3 and any("FFN node's compute" in n for n in model.notes)
    assert all(math.isfinite(predicted_cluster_step(m, s, model, c["ffn_rows"])) for s, c in zip(m.steps, m.cluster))
    assert "attention node 0" in steps_table(m, model).splitlines()[0]
    # routing attention measured too: its submit routes and groups, so it costs at least the plain one's posts
    assert [s.batch for s in m.dispatch_steps] == [1, 2, 4] and model.submit_dispatch.points == 3
    assert model.submit_dispatch(4) > 0 and model.submit(4) > 0
    # every node ran on this CPU: the host's cores and the messages' CPU beyond the model (0 or more)
    assert model.host_cores >= 1 and all(c["cpu_per_step"] > 0 for c in m.cluster) and model.message_cpu >= 0
