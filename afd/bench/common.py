"""Helpers shared by afd's benchmark commands: interleaved rounds, and running afd colocated (in this
process, with a chosen torch thread count) or disaggregated (a LocalCluster) on the same prompts."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from afd.config.fieldspec import at_least
from afd.plan.profile_measure import synthetic_prompts  # noqa: F401 (the benchmarks' prompts: one definition)


def count_flag(p: argparse.ArgumentParser, name: str, default: int, minimum: int = 1, help: str = "") -> None:
    """An int flag with its minimum checked and said in the help."""
    text = f"{help} (at least {minimum})" if help else f"at least {minimum}"
    p.add_argument(name, type=at_least(minimum), default=default, help=text)


def interleaved(
    names: Sequence[str], repeats: int, fn: Callable[[str, int], object], log: Callable[[str], None] | None = None
) -> dict[str, list]:
    """fn(name, round) for every name in every round, rotating the order each round so that slow
    phases of a noisy machine hit every name alike. Returns name -> its results, round by round."""
    out: dict[str, list] = {n: [] for n in names}
    for r in range(repeats):
        k = r % len(names)
        for n in list(names[k:]) + list(names[:k]):
            t0 = time.perf_counter()
            out[n].append(fn(n, r))
            if log:
                log(f"round {r + 1}/{repeats} {n} ({time.perf_counter() - t0:.1f}s)")
    return out


def median(xs) -> float:
    return statistics.median(list(xs))


def write_config(path: str, config: dict) -> str:
    """A model directory holding only config.json (enough for dummy weights)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@dataclass
class Run:
    """One generation: per-step timings of (the first) attention side, and what it produced."""

    outputs: list[list[int]]
    steps: list[dict]
    """{"tokens", "seconds", "ffn_wait"} per forward step; step 0 is the prefill."""
    wall_seconds: float = 0.0
    ffn: dict = field(default_factory=dict)
    """The FFN node's report (steps, tokens, compute/idle seconds); empty when colocated."""

    def decode_steps(self) -> list[dict]:
        return self.steps[1:]

    def decode_tokens_per_s(self) -> float:
        d = self.decode_steps()
        return sum(s["tokens"] for s in d) / sum(s["seconds"] for s in d)


class Colocated:
    """Both halves of one model in this process (built once, reused across rounds): an afd.LLM's."""

    def __init__(self, model_dir: str, dummy_weights: bool = False, seed: int = 0):
        from afd import LLM

        self.llm = LLM(model_dir, dummy_weights=dummy_weights, weights_seed=seed)
        self.cfg, self.backend, self.attn, self.ffn = self.llm.cfg, self.llm.backend, self.llm.attn, self.llm.ffn

    def generate(self, prompts: list[list[int]], new_tokens: int, threads: int, graph=None) -> Run:
        """Greedy, EOS ignored, with torch using `threads` threads (restored afterwards); graph: graph mode's
        settings (afd.engine.graph.GraphSettings; None: eager)."""
        import torch

        from afd.engine import offline
        from afd.engine.sampling import SamplingParams

        options = {"graph_mode": "eager"}
        if graph is not None:
            options = {"graph_mode": graph.mode, "graph_batch_sizes": graph.batch_sizes}
            options |= {"compile_cache_dir": graph.cache_dir} if graph.cache_dir else {}
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            per = [new_tokens] * len(prompts)
            engine = self.llm.job_engine(prompts, per, **options)
            steps: list[dict] = []
            t0 = time.perf_counter()
            out = offline.generate(
                engine, prompts, per, SamplingParams(), ignore_eos=True, on_step=lambda s: steps.append(s.report())
            )
            return Run(out, steps, time.perf_counter() - t0)
        finally:
            torch.set_num_threads(before)


def run_afd(
    model_dir: str,
    prompts: list[list[int]],
    new_tokens: int,
    attention_nodes: int = 1,
    ffn_nodes: int = 1,
    overlap: bool = True,
    micro_batches: int = 1,
    threads: int = 1,
    dummy_weights: bool = False,
) -> Run:
    """A LocalCluster, greedy with EOS ignored; the steps are attention node 0's, the FFN report FFN 0's."""
    from afd.cluster.local import LocalCluster
    from afd.cluster.local_config import local_job

    job = local_job(
        model_dir,
        attention_nodes,
        ffn_nodes,
        threads=threads,
        dtype="float32",
        dummy_weights=dummy_weights,
        overlap=overlap,
        micro_batches=micro_batches,
    )
    t0 = time.perf_counter()
    with LocalCluster(job) as cluster:
        cluster.start(prompts, new_tokens, ignore_eos=True)
        outputs, reports = cluster.wait()
        ffn = cluster.ffn_reports[0]
    return Run(outputs, reports[0]["steps"], time.perf_counter() - t0, ffn)
