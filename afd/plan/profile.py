"""`afd profile FILE`: measure the cost model (afd.plan.costs) of a cluster YAML's model on this machine.

Per batch size (sequences per attention rank, one micro-batch) it times decode steps of the YAML's model: on
the cluster itself at 1A1F (afd.plan.profile_check: the attention side's pieces per layer inside attention
node 0, the FFN node's compute from its own counters, the step they should add up to), or with --no-cluster
in this process (afd.plan.profile_measure: the FFN half in process too); and the data plane's messages
between two processes against their size (afd.plan.profile_link). Then it fits one line per piece
(afd.plan.costs.fit) and writes the CostModel JSON with each fit's error and the attention TP it holds at.
"""

from __future__ import annotations

import argparse
import ipaddress
import time

from afd.config.fieldspec import positive_int
from afd.plan.costs import CostModel
from afd.plan.profile_fit import Measurements, cost_model, profile_json, steps_table, table
from afd.plan.profile_link import DEFAULT_SIZES, measure_link
from afd.plan.profile_measure import measure_batch, median_sample

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def add_parser(sub) -> None:
    from afd.config.flags import DefaultsHelpFormatter

    p = sub.add_parser(
        "profile",
        help="measure the cost model (attention, FFN, link) of a cluster YAML's model here",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("config", metavar="FILE", help="cluster YAML (its model, dtype and addresses)")
    p.add_argument(
        "--batch-sizes",
        type=_sizes,
        default=",".join(map(str, DEFAULT_BATCH_SIZES)),
        help="comma-separated decode batch sizes per attention rank (at least two distinct, each at least 1)",
    )
    _count(p, "--context", 64, "prompt tokens per sequence before the timed decode steps")
    _count(p, "--steps", 8, "timed decode steps per run (2 more warm up)")
    _count(p, "--repeats", 2, "runs per batch size (medians over steps and runs)")
    _count(p, "--link-repeats", 20, "messages per size on the link")
    p.add_argument(
        "--no-cluster",
        action="store_true",
        help="do not run the cluster at 1A1F: the FFN half is then timed in process, and no cluster step is measured",
    )
    p.add_argument("--output", default="profile.json", help="where to write the cost model (JSON)")
    p.set_defaults(func=run)


def _count(p, name: str, default: int, help: str) -> None:
    """A count flag with its minimum checked and said, as the benchmarks' (afd.bench.common.count_flag, which
    afd.plan may not import: tests/test_layout.py)."""
    p.add_argument(name, type=positive_int, default=default, help=f"{help} (at least 1)")


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted({positive_int(t.strip()) for t in text.split(",") if t.strip()}))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    if len(sizes) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: at least two distinct batch sizes (a line needs two points)")
    return sizes


def _link_host(config) -> tuple[str, tuple[str, ...]]:
    """The attention node's address when it is this machine's loopback, else loopback with a note: both ends
    run here, so a remote address cannot be measured."""
    host = next(n.host for n in config.nodes if n.role == "attention")
    try:
        if ipaddress.ip_address(host).is_loopback:
            return host, ()
    except ValueError:
        pass
    return "127.0.0.1", (f"link measured on loopback here, not on {host}",)


def _host_cores(config) -> int:
    """This machine's usable CPUs when every node of the YAML runs on its CPU (the cluster the profile starts
    runs here); 0 when any has a device."""
    from afd.cluster.cpus import usable_cpus

    return usable_cpus() if all(n.device_type == "cpu" for n in config.nodes) else 0


def profile(
    path: str,
    batch_sizes=DEFAULT_BATCH_SIZES,
    context: int = 64,
    steps: int = 8,
    repeats: int = 2,
    link_repeats: int = 20,
    cluster: bool = True,
    link_sizes=DEFAULT_SIZES,
    log=print,
) -> tuple[Measurements, CostModel]:
    """Measures and fits; returns (measurements, CostModel)."""
    from afd import LLM
    from afd.config.loader import load
    from afd.dataplane.protocol import exchange_bytes

    config = load(path)
    mod = config.model
    options = dict(dtype=mod.dtype, dummy_weights=mod.dummy_weights, weights_seed=mod.seed)
    options |= {"quantization": mod.quantization} if mod.quantization else {}
    # with the cluster, the LLM only resolves the model (path, checkpoint dtype): its nodes are never started;
    # routing attention, which every family runs (a router reading the token ids runs nothing else)
    where = dict(attention_nodes=1, ffn_nodes=1, routing="attention") if cluster else {}
    llm = LLM(mod.path, block_size=config.engine.block_size, **options, **where)
    tp = config.layout.attention_tp
    host, notes = _link_host(config)
    checked: list[dict] = []
    dispatch: list = []
    if cluster:
        from afd.plan.profile_check import cluster_steps

        model = llm.config.model
        # a router that reads the token ids (DeepSeek-V4's hash layers) runs on the attention side only:
        # then the one cluster, routed there, gives both submits
        by_ids = llm.cfg.routes_by_token_ids
        first = "attention" if by_ids else "ffn"
        medians, checked = cluster_steps(model, config, batch_sizes, context, steps, repeats, log, routing=first)
        dispatch = medians
        if not by_ids:
            dispatch, _ = cluster_steps(model, config, batch_sizes, context, steps, repeats, log, routing="attention")
        notes += (
            f"attention side: timed in attention node 0 of the cluster at 1A1F, attention_tp {tp}, routing {first}"
            + (" (submit_dispatch: routing attention)" if not by_ids else ", its router reading the token ids"),
        )
    else:
        rounds: dict[int, list] = {b: [] for b in batch_sizes}
        for r in range(repeats):
            for b in batch_sizes if r % 2 == 0 else tuple(reversed(batch_sizes)):  # machine drift hits all alike
                t0 = time.perf_counter()
                rounds[b] += measure_batch(llm, b, context, steps, offset=r * 1000 + b)
                log(f"round {r + 1}/{repeats} batch {b}: {time.perf_counter() - t0:.1f}s")
        medians = [median_sample(rounds[b]) for b in batch_sizes]
        notes += ("attention side: timed in this process (--no-cluster), attention_tp 1",)
        if tp > 1:
            notes += (f"the YAML's attention_tp {tp} is not measured in process: profile with the cluster",)
            tp = 1
    link = measure_link(host, tuple(link_sizes), link_repeats)
    log(f"link: {len(link)} sizes on {host}")
    cfg = llm.cfg
    wire = exchange_bytes(1, cfg.hidden_size, llm.dtype, config.layout.exchange_dtype)  # per token, each way
    m = Measurements(
        path,
        mod.path,
        str(llm.config.model.dtype),
        context,
        cfg.experts_per_token,
        medians,
        link,
        tuple(notes),
        checked,
        len(cfg.moe_layers),
        (wire["to_ffn"], wire["to_attention"]),
        config.layout.overlap,
        tp,
        cfg.num_layers - len(cfg.moe_layers),
        _host_cores(config) if cluster else 0,
        dispatch,
    )
    return m, cost_model(m)


def run(args) -> int:
    m, model = profile(
        args.config,
        args.batch_sizes,
        args.context,
        args.steps,
        args.repeats,
        args.link_repeats,
        cluster=not args.no_cluster,
    )
    with open(args.output, "w") as f:
        f.write(profile_json(model, m))
    print(f"\n{m.model} ({m.dtype}), context {m.context}, median of {args.steps} steps x {args.repeats} runs")
    print(table(model))
    for n in model.notes:
        print(f"note: {n}")
    print()
    print(steps_table(m, model))
    print(f"wrote {args.output}")
    from afd.plan.cpu_hardware import measure, write

    spec = write(measure(link=model.link))  # this CPU's figures, for `afd plan --hardware cpu`
    print(f"wrote this CPU's hardware spec to {spec} (afd plan --hardware cpu)")
    return 0
