"""The compute part of `afd profile`: per decode step, the attention side's pieces of each layer, the FFN half
of each MoE layer and what the step spends outside the layers, at one batch size.

Two sources, one split (`split_steps`) of the runner's opt-in timer (afd.observability.timing.LayerTimes:
pre_moe, the window post_moe, the combine, and the exchange's submit):

- attention node 0 of the profiled cluster (`node_samples`, the default of `afd profile`): a job asked with
  `layer_times` (afd.cluster.local.LocalCluster.submit) returns its runner's samples and each step's end;
  the wait on the FFN nodes is the step report's ffn_wait (afd.plan.profile_check runs the jobs);
- in this process (`measure_batch`, `--no-cluster`): the YAML's model on the engine afd.LLM builds
  (afd.entrypoints.llm.LLM.job_engine: the scheduler, runner and sampler the nodes run) on one torch thread, as
  each local node gets, with the in-process exchange: `submit` runs the FFN half synchronously, so `moe` is
  the FFN half itself, with no transfer or wait. What a transfer costs is then the link's part
  (afd.plan.profile_link), measured apart.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from afd.observability.timing import LayerTimes

PIECES = ("pre", "window", "combine", "moe", "dense")


@dataclass(frozen=True)
class StepSample:
    """One decode step at `batch` sequences (T = batch tokens, one micro-batch), in seconds: each piece per
    layer of its kind (averaged over the MoE layers, or the dense ones), the FFN half per MoE layer, the whole
    step (engine step to engine step: scheduling, the runner, sampling, outputs) and what of it is outside
    the layers."""

    batch: int
    pre: float
    window: float
    combine: float
    moe: float
    dense: float
    step: float
    overhead: float
    execute: float = 0.0
    """The runner's part of the step (StepStats.seconds: what the cluster's step reports hold)."""
    wait: float = 0.0
    """Seconds of the step blocked on the FFN nodes (StepStats.ffn_wait; 0 in process). On a node, `moe` is
    the exchange's submit: the send, and without overlap also this wait."""
    spread: float = 0.0
    """Of a median over steps (median_sample): the steps' interquartile range over their median, how noisy
    the machine was (a busy machine's pieces move together, so the medians need not add up to the step's)."""


def split_steps(
    samples: list[tuple[str, int, int, float]],
    marks: list[tuple[float, int, int, float, float]],
    batch: int,
    moe_layers: int,
    dense_layers: int,
    warmup: int = 2,
    wait_in_moe: bool = False,
) -> list[StepSample]:
    """Per decode step of `batch` tokens (after `warmup` of them) from the runner's samples and the step marks
    [(time at the step's end, samples recorded by then, tokens, the runner's seconds, its ffn_wait)]. The first
    mark's step is the prefill; a step's wall time is from the previous mark to its own. The overhead is what
    the step spent outside every piece and outside the wait: under overlap the wait lies between the window and
    the combine, untimed; without it (`wait_in_moe`) inside the submit, so in `moe` already."""
    out: list[StepSample] = []
    seen = 0
    for i in range(1, len(marks)):
        t_prev, n_prev = marks[i - 1][:2]
        t, n, tokens, execute, wait = marks[i]
        if tokens != batch:
            continue
        seen += 1
        if seen <= warmup:
            continue
        total = dict.fromkeys(PIECES, 0.0)
        for piece, _layer, _t, seconds in samples[n_prev:n]:
            total[piece] += seconds
        step = t - t_prev
        per = {p: total[p] / moe_layers if moe_layers else 0.0 for p in ("pre", "window", "combine", "moe")}
        dense = total["dense"] / dense_layers if dense_layers else 0.0
        overhead = max(0.0, step - sum(total.values()) - (0.0 if wait_in_moe else wait))
        out.append(StepSample(batch, dense=dense, step=step, overhead=overhead, execute=execute, wait=wait, **per))
    return out


def node_samples(result: dict, batch: int, moe_layers: int, dense_layers: int, overlap: bool) -> list[StepSample]:
    """split_steps of an attention node's job result asked with layer_times (attention_node/worker.py: its
    "layer_times" {"samples", "marks": [(time, samples by then)] one per step} beside its step reports)."""
    lt = result["layer_times"]
    if lt is None or len(lt["marks"]) != len(result["steps"]):
        raise ValueError("the attention node's job result carries no layer times, one mark per step")
    samples = [tuple(s) for s in lt["samples"]]
    marks = [(t, n, s["tokens"], s["seconds"], s["ffn_wait"]) for (t, n), s in zip(lt["marks"], result["steps"])]
    return split_steps(samples, marks, batch, moe_layers, dense_layers, wait_in_moe=not overlap)


def measure_batch(llm, batch: int, context: int, steps: int, offset: int = 0) -> list[StepSample]:
    """`steps` timed decode steps at `batch` sequences of `context` prompt tokens (2 more warm up), on one torch
    thread. llm: a colocated afd.entrypoints.llm.LLM."""
    import torch

    from afd.engine import offline
    from afd.engine.sampling import SamplingParams

    cfg = llm.cfg
    prompts = synthetic_prompts(batch, context, cfg.vocab_size, offset)
    per = [steps + 3] * batch  # the prefill's token, 2 warm-up decode steps, then the timed ones
    engine = llm.job_engine(prompts, per, micro_batches=1)
    times = LayerTimes()
    engine.runner.layer_times = times
    marks: list[tuple[float, int, int, float, float]] = []
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        offline.generate(
            engine,
            prompts,
            per,
            SamplingParams(),
            ignore_eos=True,
            on_step=lambda s: marks.append((time.perf_counter(), len(times.samples), s.num_tokens, s.seconds, 0.0)),
        )
    finally:
        torch.set_num_threads(before)
    moe = len(cfg.moe_layers)
    return split_steps(times.samples, marks, batch, moe, cfg.num_layers - moe)


def median_sample(samples: list[StepSample]) -> StepSample:
    """Field by field median over steps (and rounds): each piece's typical time, each measured within one step;
    the overhead is each step's own remainder, not the medians' difference."""
    if not samples:
        raise ValueError("no decode step was timed")
    fields = ("pre", "window", "combine", "moe", "dense", "step", "overhead", "execute", "wait")
    med = {f: statistics.median(getattr(s, f) for s in samples) for f in fields}
    steps = [s.step for s in samples]
    q = statistics.quantiles(steps, n=4) if len(steps) > 1 else [steps[0]] * 3
    return StepSample(samples[0].batch, **med, spread=(q[2] - q[0]) / med["step"] if med["step"] else 0.0)


def synthetic_prompts(n: int, length: int, vocab: int, offset: int = 0) -> list[list[int]]:
    """n distinct, deterministic prompts of equal length over ids [3, vocab) (0-2 are special): the profile's
    and the benchmarks' (afd.bench.common re-exports it); distinct offsets keep runs off each other's prefixes."""
    return [[3 + ((i + offset) * 7 + j * 13) % (vocab - 3) for j in range(length)] for i in range(n)]
