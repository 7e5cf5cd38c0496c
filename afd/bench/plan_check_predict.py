"""`afd bench-plan`'s predictions: the simulator (afd.plan.simulate) on the cluster YAML each stored run ran,
with the stored profile's CostModel, as like for like with the measured step as the reports allow."""

from __future__ import annotations

import dataclasses
import json

from afd.bench.common import median
from afd.bench.plan_check_table import Case, Row


def predict(case: Case, run: dict, costs, outside, batch: int, link_spec, qdisc: str = "") -> tuple[float, float, str]:
    """(step s, attention wait s, bottleneck) of the simulator on the YAML that ran, less the engine's share
    outside the runner (`outside`, a Linear in sequences). Behind the emulated link see `_shaped`."""
    from afd.config.loader import from_dict
    from afd.model.demo_config import DEMO_CONFIG
    from afd.model.registry import config_from_hf
    from afd.plan.scenario import Scenario
    from afd.plan.shape import ModelShape
    from afd.plan.simulate import simulate

    cfg = from_dict(run["cluster"])
    shape = ModelShape.from_config(config_from_hf(DEMO_CONFIG), "float32", "demo")
    scenario = Scenario.from_cluster(cfg, shape, costs, batch, case.micro_batches)
    pred = simulate(scenario)
    if case.link and link_spec is not None and link_spec.rate:
        slowed = _shaped(scenario, pred, link_spec.bytes_per_second(), qdisc)
        pred = simulate(slowed) if slowed is not None else pred
    return pred.step_time - outside(batch), pred.attention_wait, pred.bottleneck


def _shaped(scenario, pred, rate: float, qdisc: str):
    """The scenario behind a link shaped to `rate` bytes/s each way (one qdisc per direction for every FFN node:
    afd.cluster.link), or None when the shaping costs nothing. netem serializes every message at the rate; tbf
    is a token bucket of `burst` bytes refilled at the rate, which delays no message while the traffic it
    carries stays under the rate and each message fits the bucket (https://man7.org/linux/man-pages/man8/tc-tbf.8.html):
    then the loopback link stands; past that the rate is the link's bandwidth."""
    import re

    from afd.plan.costs import Link

    costs = scenario.costs
    burst = re.search(r"\bburst (\d+)", qdisc)
    if qdisc.startswith("tbf") and burst:
        lay = scenario.layout
        sizes = [b for i in range(lay.micro_batches) for f in range(lay.ffn_nodes) for b in _sizes(scenario, i, f)]
        busiest = max(pred.bytes_to_ffn, pred.bytes_to_attention) / pred.step_time
        if busiest <= rate and max(sizes) <= int(burst.group(1)):
            return None
    bw = min(costs.link.bandwidth, rate)
    link = Link(costs.link.latency, bw, costs.link.rel_err)
    return dataclasses.replace(scenario, costs=dataclasses.replace(costs, link=link))


def _sizes(scenario, i: int, f: int) -> list[float]:
    to_ffn, back = scenario.messages(i, f)
    return [*to_ffn, back]


def rows_of(doc: dict) -> list[Row]:
    """Predictions for every stored run with the current simulator: each round from that round's profile
    (`profiles`; a run stored before them has one `profile` for every round)."""
    from afd.cluster.link import LinkSpec
    from afd.plan.costs import Linear

    rounds = doc.get("profiles") or [{"profile": doc["profile"], "outside_runner": doc["outside_runner"]}]
    models = [(_costs(p["profile"]), Linear(**p["outside_runner"])) for p in rounds]
    cores = doc["setting"].get("host_cores", 0)
    batch, qdisc = doc["setting"]["batch"], doc["setting"].get("link_qdisc", "")
    rows = []
    for r in doc["runs"]:
        case = Case(**r["case"])
        spec = LinkSpec.parse(case.link) if case.link else None
        preds, measured, ratios = [], [], []
        for k, rnd in enumerate(r["rounds"]):
            costs, outside = models[k % len(models)]
            preds.append(predict(case, rnd, _mine(costs, cores, rnd), outside, batch, spec, qdisc))
            measured.append(median(s[0] for s in rnd["steps"]))
            ratios.append(preds[-1][0] / measured[-1])
        waits = [s[1] for rnd in r["rounds"] for s in rnd["steps"]]
        step, wait = median(p[0] for p in preds), median(p[1] for p in preds)
        row = Row(case, 1e3 * median(measured), 1e3 * step, 1e3 * median(waits), 1e3 * wait, len(preds), preds[0][2])
        rows.append(dataclasses.replace(row, round_ratio=median(ratios)))
    return rows


def _costs(profile: dict):
    """A stored profile's CostModel, fitted again by the current afd.plan.profile_fit where its measurements
    were stored whole (so a replay follows a change to the fits as well as to the simulator)."""
    from afd.plan.costs import CostModel
    from afd.plan.profile_fit import cost_model, measurements_of

    m = measurements_of(profile)
    return cost_model(m) if m is not None else CostModel.from_json(json.dumps(profile))


def available_cores(cores: int, other: float) -> int:
    """The host's cores left to the nodes while others' work took `other` cores' worth, to the nearest whole
    core (the simulator's cores run whole tasks) and at least one."""
    return max(1, round(cores - other))


def _mine(costs, cores: int, rnd: dict):
    """The CostModel with the cores the nodes had in that round: the host's, less what other work took then."""
    if not cores:
        return costs
    return dataclasses.replace(costs, host_cores=available_cores(cores, rnd.get("other_cores", 0.0)))
