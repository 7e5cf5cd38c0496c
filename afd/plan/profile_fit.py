"""From `afd profile`'s measurements to the shared cost model (afd.plan.costs): one least-squares line per
piece, the link's latency and bandwidth, and the JSON that keeps the measurements beside the fits."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from afd.plan.costs import CostModel, LayerCosts, Linear, Link, fit
from afd.plan.profile_link import LinkSample
from afd.plan.profile_measure import StepSample

MIN_BANDWIDTH_SLOPE = 1e-15
"""Seconds per byte below which a fitted slope is taken as noise (a link faster than 1 PB/s): the bandwidth
is then capped there rather than infinite, which JSON cannot hold."""


@dataclass(frozen=True)
class Measurements:
    """What one `afd profile` run measured: a median StepSample per batch size, the link's samples, and the
    setting they were measured at."""

    config: str
    model: str
    dtype: str
    context: int
    """Prompt tokens per sequence before the timed decode steps (the KV each decode step reads, +/- steps)."""
    experts_per_token: int
    steps: list[StepSample]
    link: list[LinkSample]
    notes: tuple[str, ...] = ()
    cluster: list[dict] = field(default_factory=list)
    """The cluster's own decode step per batch size (afd.plan.profile_check), when it was run."""
    moe_layers: int = 0
    bytes_per_token: tuple[int, int] = (0, 0)
    """Bytes of one token's MoE input and of its output on the wire (afd.dataplane.protocol.exchange_bytes at
    the YAML's exchange_dtype)."""
    overlap: bool = True
    """The YAML's layout.overlap, which the cluster ran with."""
    attention_tp: int = 1
    """The attention TP the attention side was measured at (the YAML's with the cluster; 1 in process)."""
    dense_layers: int = 0
    host_cores: int = 0
    """The CPUs every node process shared where the cluster ran on this machine's CPU (usable_cpus); 0 on
    devices or in process."""
    dispatch_steps: list[StepSample] = field(default_factory=list)
    """With the cluster: attention node 0's median StepSample per batch size under routing attention (`steps`
    are under routing ffn), for CostModel.submit_dispatch."""


def _fit_or_zero(xs: list[float], ts: list[float]) -> Linear:
    """A line, or Linear(0, 0) with no points where nothing of that kind was measured (a model with no dense
    layer) or the times are all zero."""
    if not any(ts):
        return Linear(0.0, 0.0)
    return fit(xs, ts)


def fit_link(samples: list[LinkSample]) -> Link:
    line = fit([float(s.nbytes) for s in samples], [s.seconds for s in samples])
    return Link(line.intercept, 1.0 / max(line.slope, MIN_BANDWIDTH_SLOPE), line.rel_err)


def cost_model(m: Measurements) -> CostModel:
    """Attention pieces (attention node 0's with the cluster, else in process) against tokens per attention
    rank (= batch: one node, one micro-batch; every TP rank computes each token's heads share); the FFN half
    against token-expert rows on its node: measured on the cluster's FFN node when the cluster ran (routed
    rows, identity experts' not), else in process (batch x experts_per_token); the step overhead against
    sequences; the link against bytes."""
    b = [float(s.batch) for s in m.steps]
    if m.cluster and all(c.get("ffn_rows", 0) > 0 for c in m.cluster):
        ffn = fit([c["ffn_rows"] for c in m.cluster], [c["ffn_seconds"] for c in m.cluster])
        where = "the FFN node's compute per layer pass at 1A1F against the routed token-expert rows it computed"
    else:
        ffn = fit([x * m.experts_per_token for x in b], [s.moe for s in m.steps])
        where = "the FFN half in process against tokens x experts_per_token (identity experts' slots included)"
    layer = LayerCosts(
        attn_pre=fit(b, [s.pre for s in m.steps]),
        attn_window=_fit_or_zero(b, [s.window for s in m.steps]),
        attn_post=_fit_or_zero(b, [s.combine for s in m.steps]),
        ffn=ffn,
    )
    link = fit_link(m.link)
    submit, submit_dispatch = _submit(b, m.steps, m), Linear(0.0, 0.0)
    if m.dispatch_steps:
        submit_dispatch = _submit([float(s.batch) for s in m.dispatch_steps], m.dispatch_steps, m)
    handling = ffn_message(m, layer.ffn, link)
    handling_dispatch = ffn_message(m, layer.ffn, link, dispatch=True) if m.dispatch_steps else 0.0
    dense, step_overhead = _fit_or_zero(b, [s.dense for s in m.steps]), fit(b, [s.overhead for s in m.steps])
    notes = [
        f"context {m.context} tokens per sequence; batch sizes {sorted({s.batch for s in m.steps})}",
        f"ffn: {where}",
        f"link: median one-way times, {len(m.link)} sizes {m.link[0].nbytes}-{m.link[-1].nbytes} B",
    ]
    if all(s.fastest > 0 for s in m.link):
        fast = fit_link([LinkSample(s.nbytes, s.fastest) for s in m.link])
        notes.append(
            f"link on the fastest times instead: latency {1e6 * fast.latency:.1f} us, bandwidth "
            f"{fast.bandwidth / 1e9:.2f} GB/s, error {100 * fast.rel_err:.0f}% (the median carries a busy "
            "machine's wake-up latency)"
        )
    return CostModel(
        source=f"profile {m.config}",
        model=m.model,
        dtype=m.dtype,
        moe_layer=layer,
        dense_layer=dense,
        step_overhead=step_overhead,
        link=link,
        notes=(*notes, *m.notes),
        attention_tp=m.attention_tp,
        submit=submit if m.cluster else Linear(0.0, 0.0),  # in process the exchange is a call: nothing posted
        submit_dispatch=submit_dispatch,
        ffn_message=handling,
        ffn_message_dispatch=handling_dispatch,
        host_cores=m.host_cores,
        rendezvous=m.host_cores > 0,  # every node on this CPU: its data plane is gloo's
        message_cpu=message_cpu(m, layer, step_overhead, dense, submit, handling) if m.host_cores else 0.0,
    )


def ffn_message(m: Measurements, ffn: Linear, link: Link, dispatch: bool = False) -> float:
    """The FFN node's time per message beyond its compute: without overlap, each MoE layer's wait (the step's
    over its MoE layers) less the link both ways at the batch's bytes and the FFN fit at the rows the node
    computed; the median over batch sizes, at least 0. 0 under overlap or without the cluster. `dispatch`: from
    the cluster under routing attention, whose wait also holds the count message and the combine."""
    if m.overlap or not m.cluster or not m.moe_layers:
        return 0.0
    to_ffn, back = m.bytes_per_token
    count = link(8.0) if dispatch else 0.0  # the count message before the rows (an int64)
    per_batch = []
    for s, c in zip(m.dispatch_steps if dispatch else m.steps, m.cluster):
        trip = link(s.batch * to_ffn) + count + ffn(c.get("ffn_rows", 0.0)) + link(s.batch * back)
        per_batch.append(max(0.0, s.wait / m.moe_layers - trip) / m.attention_tp)
    return sorted(per_batch)[len(per_batch) // 2] if per_batch else 0.0


def _submit(b: list[float], steps: list[StepSample], m: Measurements) -> Linear:
    """The exchange's submit per MoE layer against tokens: the node's `moe` piece, less the step's wait over
    its MoE layers where the piece holds it (without overlap)."""
    held = 0.0 if m.overlap or not m.moe_layers else 1.0 / m.moe_layers
    return _fit_or_zero(b, [max(0.0, s.moe - held * s.wait) for s in steps])


def message_cpu(
    m, layer: LayerCosts, step_overhead: Linear, dense: Linear, submit: Linear = Linear(0.0, 0.0), handling: float = 0.0
) -> float:
    """CPU seconds per message the node processes spent beyond what the cost model charges them: per batch size,
    every process's CPU per step (the cluster's one-token job) less the attention ranks' modelled busy time
    and the FFN node's compute, over the step's messages (one each way per MoE layer and attention rank at
    1A1F, one micro-batch); the median over batch sizes, at least 0."""
    per_batch = []
    for c in m.cluster:
        b, tp = c["batch"], m.attention_tp
        if not c.get("cpu_per_step") or not m.moe_layers:
            continue
        attention = (
            step_overhead(b)
            + m.moe_layers * (layer.attn_pre(b) + layer.attn_window(b) + layer.attn_post(b))
            + m.dense_layers * dense(b)
        )
        charged = tp * attention + m.moe_layers * (c["ffn_seconds"] + handling * tp)
        per_batch.append(max(0.0, c["cpu_per_step"] - charged) / (2 * m.moe_layers * tp))
    return sorted(per_batch)[len(per_batch) // 2] if per_batch else 0.0


def profile_json(model: CostModel, m: Measurements) -> str:
    """The CostModel's JSON (CostModel.from_json reads it back) with the measurements under `measurements`,
    which from_json ignores and measurements_of reads back (a stored profile can be fitted again)."""
    d = json.loads(model.to_json())
    d["measurements"] = asdict(m)
    return json.dumps(d, indent=2)


def measurements_of(d: dict) -> Measurements | None:
    """The Measurements a profile_json document holds, or None for one written before they were whole."""
    x = d.get("measurements", {})
    if "config" not in x:
        return None
    steps = [StepSample(**s) for s in x["steps"]]
    rest = {k: v for k, v in x.items() if k not in ("steps", "link", "dispatch_steps", "notes", "bytes_per_token")}
    return Measurements(
        **rest,
        steps=steps,
        link=[LinkSample(**s) for s in x["link"]],
        notes=tuple(x["notes"]),
        bytes_per_token=tuple(x["bytes_per_token"]),
        dispatch_steps=[StepSample(**s) for s in x.get("dispatch_steps", [])],
    )


def table(model: CostModel) -> str:
    """The fits, one line each: slope, intercept, worst relative error, points."""
    rows = [
        ("attn_pre (per token)", model.moe_layer.attn_pre),
        ("submit, routing ffn (per token)", model.submit),
        ("submit, routing attention (per token)", model.submit_dispatch),
        ("attn_window (per token)", model.moe_layer.attn_window),
        ("attn_post (per token)", model.moe_layer.attn_post),
        ("ffn (per token-expert row)", model.moe_layer.ffn),
        ("dense layer (per token)", model.dense_layer),
        ("step overhead (per sequence)", model.step_overhead),
    ]
    out = ["| piece | slope (us) | intercept (us) | fit error | points |", "|---|---|---|---|---|"]
    for name, f in rows:
        out.append(f"| {name} | {1e6 * f.slope:.3f} | {1e6 * f.intercept:.1f} | {100 * f.rel_err:.1f}% | {f.points} |")
    link = model.link
    out.append(
        f"| link | {1e6 / link.bandwidth:.6f} us/B ({link.bandwidth / 1e9:.2f} GB/s) | {1e6 * link.latency:.1f} "
        f"| {100 * link.rel_err:.1f}% | - |"
    )
    if model.ffn_message:
        out.append(f"| FFN node's loop (per message, outside compute) | - | {1e6 * model.ffn_message:.1f} | - | - |")
    if model.host_cores:
        out.append(
            f"| message CPU (per message, {model.host_cores} host cores) | - | {1e6 * model.message_cpu:.1f} | - | - |"
        )
    return "\n".join(out)


def predicted_cluster_step(m: Measurements, s: StepSample, model: CostModel, rows: float) -> float:
    """Attention node 0's runner step with its measured exchange (each MoE layer's submit, and the wait on the
    FFN node) replaced by the fitted one: the MoE input and its result over the link, the FFN fit at `rows`
    token-expert rows per pass between, less what the window hides under overlap. A check of the link, the
    FFN fit and the window against the real exchange, not the simulator."""
    to_ffn, back = m.bytes_per_token
    link = model.link
    rt = link(s.batch * to_ffn) + model.moe_layer.ffn(rows) + link(s.batch * back)
    wait = max(0.0, rt - s.window) if m.overlap else rt
    measured = m.moe_layers * s.moe + (s.wait if m.overlap else 0.0)  # without overlap the submit holds the wait
    return s.execute - measured + m.moe_layers * wait


def steps_table(m: Measurements, model: CostModel) -> str:
    """Per batch size: the runner step (attention node 0's with the cluster, else in process) and its noise;
    with the cluster, its wait on the FFN node and what the fitted exchange predicts for it."""
    where = "attention node 0" if m.cluster else "in-process"
    head = f"| batch | {where} runner step (ms) | step spread (IQR) |"
    out = [head + (" its wait | predicted (ms) |" if m.cluster else "")]
    out.append("|---" * (5 if m.cluster else 3) + "|")
    cluster = {c["batch"]: c for c in m.cluster}
    for s in m.steps:
        line = f"| {s.batch} | {1e3 * s.execute:.2f} | {100 * s.spread:.0f}% |"
        c = cluster.get(s.batch)
        if c is not None:
            pred = predicted_cluster_step(m, s, model, c.get("ffn_rows", 0.0))
            line += f" {100 * c['wait_fraction']:.0f}% | {1e3 * pred:.2f} |"
        out.append(line)
    return "\n".join(out)
