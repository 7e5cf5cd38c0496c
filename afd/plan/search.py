"""`afd plan`'s search: over attention nodes A, FFN nodes F, attention TP, micro-batches m, routing and the
exchange dtype, the largest batch per attention node B whose predicted TPOT meets the SLO, then the plans
ranked by output tokens per second per device.

B is found by bisection over powers of two (a step's time grows with B; MegaScale-Infer's search does the
same per layout), so a layout costs a handful of simulations, not one per batch size."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from afd.plan.costs import CostModel
from afd.plan.scenario import Scenario
from afd.plan.shape import Layout, ModelShape
from afd.plan.simulate import StepPrediction, simulate

COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
"""Node counts tried for A and F (all counts up to 4, then a geometric grid: the objective is flat nearby)."""
BATCHES = tuple(2**i for i in range(11))
"""Sequences per attention node tried: 1 .. 1024."""


@dataclass(frozen=True)
class Space:
    devices: int
    """Devices the plan may use at most (attention ranks + FFN nodes)."""
    tp_sizes: tuple[int, ...] = (1,)
    micro_batches: tuple[int, ...] = (1, 2, 3, 4)
    routings: tuple[str, ...] = ("ffn", "attention")
    exchange_dtypes: tuple[str, ...] = ("same",)

    def __post_init__(self):
        if self.devices < 2:
            raise ValueError(f"--devices {self.devices}: AFD needs at least 2 (an attention and an FFN device)")

    def layouts(self, max_ffn: int) -> Iterator[tuple[int, int, int, int, str, str]]:
        """(A, F, TP, m, routing, exchange dtype) within the device budget; routing attention only with F > 1
        (with one FFN node the two routings send the same rows), unless it is the only routing searched."""
        for tp in self.tp_sizes:
            for a in COUNTS:
                for f in COUNTS:
                    if a * tp + f > self.devices or f > max_ffn:
                        continue
                    for routing in self.routings:
                        if routing == "attention" and f == 1 and "ffn" in self.routings:
                            continue
                        for xd in self.exchange_dtypes:
                            for m in self.micro_batches:
                                yield a, f, tp, m, routing, xd


@dataclass(frozen=True)
class Plan:
    layout: Layout
    prediction: StepPrediction
    memory: dict[str, float]
    """Bytes per device by role ("attention", "ffn"), where the cost source knows them."""


Costs = Callable[[Layout], CostModel]
"""A layout -> its cost model. A roofline differs per layout (E_local, TP, routing) and is linearised at the
layout's own tokens and rows: an FFN node's time bends where the experts it holds are all touched, and a line
fitted elsewhere misses it by up to 3x (what afd plan's Step-3 check found)."""
Fits = Callable[[Layout], dict[str, float] | None]
"""A layout -> its bytes per device by role when they fit the devices, None when they do not."""


def search(shape: ModelShape, costs: Costs, space: Space, tpot_slo: float, fits: Fits) -> tuple[list[Plan], dict]:
    """Every layout's best batch under the SLO, best first; and why layouts were left out (counts and the
    closest miss), for the message when nothing is left."""
    plans: list[Plan] = []
    misses = {"tpot": 0, "memory": 0, "fastest_tpot": float("inf")}
    for a, f, tp, m, routing, xd in space.layouts(shape.n_routed_experts):
        best = None
        lo, hi = 0, len(BATCHES) - 1
        while lo <= hi:  # the largest B in BATCHES (>= m) whose TPOT meets the SLO and whose memory fits
            mid = (lo + hi) // 2
            b = BATCHES[mid]
            if b < m:
                lo = mid + 1
                continue
            layout = Layout(a, f, b, m, tp, True, routing, xd)
            memory = fits(layout)
            if memory is None:
                misses["memory"] += 1
                hi = mid - 1
                continue
            pred = simulate(Scenario(shape, layout, costs(layout)))
            misses["fastest_tpot"] = min(misses["fastest_tpot"], pred.tpot)
            if pred.tpot <= tpot_slo:
                best = Plan(layout, pred, memory)
                lo = mid + 1
            else:
                misses["tpot"] += 1
                hi = mid - 1
        if best is not None:
            plans.append(best)
    plans.sort(key=lambda p: (-p.prediction.tokens_per_s_per_device, p.layout.devices))
    return plans, misses


def no_plan(misses: dict, tpot_slo: float) -> str:
    """Why the search found nothing: the constraint, and by how much the closest layout missed it."""
    if misses["fastest_tpot"] == float("inf"):
        return "no layout fits the devices' memory (weights and KV cache): use more devices or --quantization"
    over = misses["fastest_tpot"] / tpot_slo - 1
    return (
        f"no layout meets --tpot-slo {tpot_slo * 1e3:g} ms: the fastest predicted step takes "
        f"{misses['fastest_tpot'] * 1e3:.2f} ms ({over:.0%} over); relax the SLO or allow more devices"
    )


def table(plans: list[Plan], top: int) -> str:
    head = f"{'A':>3} {'TP':>3} {'F':>3} {'m':>2} {'B':>5} {'routing':>9} {'xdtype':>6} {'devs':>5} "
    head += f"{'TPOT ms':>8} {'tok/s/dev':>10} {'bound':>9} {'attn wait':>9}"
    lines = [head]
    for p in plans[:top]:
        lay, pr = p.layout, p.prediction
        lines.append(
            f"{lay.attention_nodes:>3} {lay.attention_tp:>3} {lay.ffn_nodes:>3} {lay.micro_batches:>2} {lay.batch:>5} "
            f"{lay.routing:>9} {lay.exchange_dtype:>6} {lay.devices:>5} {pr.tpot * 1e3:>8.2f} "
            f"{pr.tokens_per_s_per_device:>10.1f} {pr.bottleneck:>9} {pr.attention_wait / pr.step_time:>9.0%}"
        )
    return "\n".join(lines)
