"""`afd bench-plan`'s table and JSON from its measurements and predictions (pure: no torch, no cluster), so
that tests can build them from synthetic numbers and `--replay` can re-predict a stored run."""

from __future__ import annotations

from dataclasses import asdict, dataclass

BAR = 0.20
"""The planner's bar: the predicted decode step within 20 % of the measured one."""


@dataclass(frozen=True)
class Case:
    """One measured configuration: A attention and F FFN nodes, overlap, m micro-batches, routing, and the
    emulated link's rate (None: loopback)."""

    attention_nodes: int
    ffn_nodes: int
    overlap: bool
    micro_batches: int
    routing: str = "ffn"
    link: str | None = None

    @property
    def name(self) -> str:
        m = self.micro_batches
        mode = "no overlap" if not self.overlap else (f"overlap m={m}" if m == 1 else f"ping-pong m={m}")
        route = f", routing {self.routing}" if self.ffn_nodes > 1 else ""
        link = f", link {self.link}" if self.link else ""
        return f"{self.attention_nodes}A{self.ffn_nodes}F {mode}{route}{link}"


@dataclass(frozen=True)
class Row:
    """One line of the table, in milliseconds: the measured runner step (median over decode steps and rounds)
    and its wait on the FFN side, beside the simulator's."""

    case: Case
    measured_ms: float
    predicted_ms: float
    wait_measured_ms: float
    wait_predicted_ms: float
    rounds: int = 1
    bottleneck: str = ""
    round_ratio: float = 0.0
    """The median over rounds of each round's predicted / measured (each round predicted from its own
    profile); 0: not kept, the ratio of the two medians stands."""

    @property
    def ratio(self) -> float:
        if self.round_ratio:
            return self.round_ratio
        return self.predicted_ms / self.measured_ms if self.measured_ms else float("nan")

    @property
    def within_bar(self) -> bool:
        return abs(self.ratio - 1.0) <= BAR


def table(rows: list[Row]) -> str:
    """The markdown table the report prints and docs/benchmarks/planner.md holds."""
    out = [
        "| config | measured step (ms) | predicted (ms) | predicted / measured (median of rounds) | "
        "attention wait measured / predicted (ms) | bottleneck (predicted) | within 20 % |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r.case.name} | {r.measured_ms:.2f} | {r.predicted_ms:.2f} | {r.ratio:.2f} | "
            f"{r.wait_measured_ms:.2f} / {r.wait_predicted_ms:.2f} | {r.bottleneck or '-'} | "
            f"{'yes' if r.within_bar else 'no'} |"
        )
    hits = sum(r.within_bar for r in rows)
    out.append(f"\n{hits} of {len(rows)} configurations within {BAR:.0%}.")
    return "\n".join(out)


def threads_table(runs: list[dict]) -> str:
    """Each node process's CPU and run-queue wait per forward step (the job's prefill and decode steps; medians
    over rounds; the runs' `threads_per_step`): the main thread's, and the other threads' (the transport's
    loops above all). '' for runs stored before they were measured."""
    from afd.bench.common import median

    if not runs or not all("threads_per_step" in rnd for r in runs for rnd in r["rounds"]):
        return ""
    out = [
        "| config | node | main thread CPU / run-queue wait (ms) | other threads CPU / run-queue wait (ms) |",
        "|---|---|---|---|",
    ]
    for r in runs:
        name = Case(**r["case"]).name
        for node in r["rounds"][0]["threads_per_step"]:
            t = [1e3 * median(rnd["threads_per_step"][node][i] for rnd in r["rounds"]) for i in range(4)]
            out.append(f"| {name} | {node} | {t[0]:.2f} / {t[1]:.2f} | {t[2]:.2f} / {t[3]:.2f} |")
    return "\n".join(out)


def to_json(rows: list[Row], setting: dict) -> dict:
    """What docs/bench/plan_check.json holds: the setting (weights, batch, machine) and one dict per row."""
    return {
        "setting": setting,
        "rows": [asdict(r) | {"name": r.case.name, "ratio": r.ratio, "within_bar": r.within_bar} for r in rows],
    }


def rows_from_json(doc: dict) -> list[Row]:
    """The rows of a to_json document (the predictions as they were stored)."""
    keep = ("measured_ms", "predicted_ms", "wait_measured_ms", "wait_predicted_ms", "rounds", "bottleneck")
    return [
        Row(Case(**r["case"]), **{k: r[k] for k in keep}, round_ratio=r.get("round_ratio", 0.0)) for r in doc["rows"]
    ]
