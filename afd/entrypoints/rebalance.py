"""`afd rebalance FILE`: a new `layout.placement` from the experts' measured loads (afd.cluster.rebalance).

The loads are `afd_expert_tokens_total`, summed over the FFN nodes by the `expert` label: each holder of a
replicated expert counts only the tokens it computed (afd/observability/ffn_metrics.py), so the sum is the
expert's load. They are counters since each node started: a node restarted since counts less. The budget
is expert slots per FFN node: `--expert-slots`, or `--memory-budget` bytes over one expert's weights in
every MoE layer (MTP layers left out), or by default the current placement's largest node plus a quarter
of the even share (n_routed / F), rounded up, so that a few hot experts get a replica each.

It edits the YAML; with --apply it then restarts the FFN nodes one at a time to load it
(afd/cluster/rebalance_apply.py).
"""

from __future__ import annotations

import dataclasses
import os
import urllib.request

from afd.config.fieldspec import positive_int, size_arg
from afd.config.flags import DefaultsHelpFormatter
from afd.config.placement import Placement, format_experts
from afd.errors import UserError

METRIC = "afd_expert_tokens_total"
SCRAPE_TIMEOUT = 5.0
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "rebalance",
        help="place the routed experts (with replicas) from their measured loads",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("config", metavar="FILE", help="cluster YAML")
    p.add_argument(
        "--metrics",
        action="append",
        metavar="PATH",
        help="read an FFN node's saved /metrics text here instead of scraping the nodes (repeatable: one per node)",
    )
    budget = p.add_mutually_exclusive_group()
    budget.add_argument(
        "--expert-slots",
        type=positive_int,
        metavar="N",
        help="routed experts each FFN node may hold; default: the current largest node + 25%% of n_routed / F, "
        "rounded up",
    )
    budget.add_argument(
        "--memory-budget",
        type=size_arg,
        metavar="BYTES",
        help="expert weight bytes per FFN node (80GiB, or bytes): slots = BYTES / one expert's weights in every "
        "MoE layer (MTP layers left out)",
    )
    p.add_argument(
        "--min-replicas",
        type=positive_int,
        metavar="N",
        help="FFN nodes each routed expert is held by, at least; default: the fewest any expert has now, so that "
        "a layout where every expert survives a node's loss keeps that (1 lets it go)",
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument("--write", action="store_true", help="rewrite FILE's layout.placement (its comments are not kept)")
    out.add_argument("--output", metavar="PATH", help="write the new YAML here instead")
    out.add_argument(
        "--apply",
        action="store_true",
        help="--write, then restart the FFN nodes one at a time through the coordinator to load it (their "
        "supervisor starts each again; afd/cluster/rebalance_apply.py)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from afd.cluster.rebalance import imbalance, node_loads, rebalance
    from afd.cluster.topology import local_model
    from afd.config.loader import check_expert_layout, load

    cfg = load(args.config)
    if cfg.colocated:
        raise UserError(f"{args.config}: no FFN nodes: there is no placement to rebalance")
    model_cfg, quantized = model_of(cfg)
    n_routed = model_cfg.n_routed_experts
    current = check_expert_layout(cfg, n_routed, model_cfg.expert_groups[0])
    assert current is not None  # the cluster has FFN nodes (checked above)
    loads, source = read_loads(cfg, args.metrics, n_routed)
    # model.dtype auto: the checkpoint's, for the bytes of an expert (the YAML written keeps `auto`)
    slots, why = budget_of(args, local_model(cfg)[0], current, model_cfg, quantized)
    try:
        new = rebalance(loads, current.nodes, slots, current, args.min_replicas)
    except ValueError as e:
        raise UserError(f"{e} (budget: {why})") from None
    print(f"{args.config}: {n_routed} routed experts on {len(current.nodes)} FFN nodes; loads {source}")
    print(f"budget: {slots} expert slots per node ({why})")
    before, after = node_loads(current, loads), node_loads(new, loads)
    total = sum(loads)
    print(f"{'':<12}{'current':>20}{'new':>20}   (experts held, share of the load)")
    for i, name in enumerate(current.nodes):
        cells = [
            f"{len(p.held[i]):>3} experts {load / total:>6.1%}" for p, load in ((current, before[i]), (new, after[i]))
        ]
        print(f"{name:<12}{cells[0]:>20}{cells[1]:>20}")
    print(f"{'max/mean':<12}{imbalance(current, loads):>20.3f}{imbalance(new, loads):>20.3f}")
    replicated = [e for e in range(n_routed) if len(new.holders(e)) > 1]
    print(f"new placement (replicated: {format_experts(replicated) or 'none'}):")
    for name, held in zip(new.nodes, new.held):
        print(f"  {name}: {format_experts(held)}")
    if model_cfg.expert_groups[0] > 1:
        print(
            f"note: the router's {model_cfg.expert_groups[0]} expert groups are not kept together on nodes, so a "
            "token may reach more FFN nodes (`afd check-config` on the new YAML prints the fan-out)"
        )
    if new == current:
        print("the current placement is already at least as even: nothing to change")
        if args.write or args.apply:
            return 0  # FILE as it is, comments and all
    if args.write or args.output or args.apply:
        path = args.output or args.config
        write(cfg, new, path, n_routed, model_cfg.expert_groups[0])
        print(f"wrote {path}" + ("; layout.routing: attention (replicas need it)" if new.replicated else ""))
    if args.apply:
        from afd.cluster.rebalance_apply import apply
        from afd.control.cluster_client import cluster_status, restart_node

        try:
            apply(load(path), current, new, lambda n: restart_node(cfg, n), lambda: cluster_status(cfg))
        except RuntimeError as e:
            raise UserError(str(e)) from None
        print(
            f"applied: max/mean node load {imbalance(current, loads):.3f} -> {imbalance(new, loads):.3f} "
            "(by the loads read)"
        )
    return 0


def model_of(cfg):
    """(the model's config, whether its experts' weights are 8-bit), read as `afd check-config` reads them."""
    from afd.cluster.topology import model_dir
    from afd.model.config import ConfigError
    from afd.model.demo_config import DEMO_CONFIG
    from afd.model.registry import config_from_hf, load_config, quant_spec
    from afd.quant.scheme import resolve

    path = cfg.model.path
    if path == "demo":
        return config_from_hf(DEMO_CONFIG), resolve(cfg.model.quantization, None) is not None
    try:
        path = model_dir(cfg, download=False)
    except ConfigError as e:
        raise UserError(f"model.path: {e}: rebalance needs the model's expert count") from None
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UserError(f"model.path {path}: no config.json here: rebalance needs the model's expert count")
    return load_config(path), quant_spec(path, cfg.model.quantization) is not None


def expert_bytes(model_cfg, dtype: str, quantized: bool) -> int:
    """One routed expert's weights over every MoE layer: gate, up and down, 3 x hidden x its intermediate
    size, 1 byte each when quantized (scales left out: one per 128 x 128 block or per row), else the dtype's.
    MTP layers are left out (a few percent more on a node that runs them)."""
    inter = model_cfg.expert_intermediate_size
    per_weight = 1 if quantized else DTYPE_BYTES[dtype]
    return 3 * model_cfg.hidden_size * inter * per_weight * len(model_cfg.moe_layers)


def budget_of(args, cfg, current: Placement, model_cfg, quantized: bool) -> tuple[int, str]:
    """(slots per node, how they were chosen)."""
    n, F = current.n_routed, len(current.nodes)
    if args.expert_slots is not None:
        return args.expert_slots, "--expert-slots"
    if args.memory_budget is not None:
        one = expert_bytes(model_cfg, cfg.model.dtype, quantized)
        return args.memory_budget // one, f"--memory-budget {args.memory_budget} B / {one} B per expert"
    largest = max(len(h) for h in current.held)
    extra = -(-n // (4 * F))
    return largest + extra, f"default: the largest node's {largest} + 25% of {n}/{F}, rounded up"


def read_loads(cfg, paths: list[str] | None, n_routed: int) -> tuple[list[float], str]:
    """Tokens per routed expert (0 for one no file or node counts), summed over the FFN nodes' /metrics
    (or the saved files), and where they came from."""

    texts = []
    if paths:
        for path in paths:
            try:
                with open(path) as f:
                    texts.append((path, f.read()))
            except OSError as err:
                raise UserError(f"--metrics {path}: {err.strerror or err}") from None
        where = f"from {len(paths)} saved /metrics file(s)"
    else:
        texts = [(f"{n.name} ({_url(n)})", scrape(n, cfg.source)) for n in cfg.ffn_nodes]
        where = f"from {len(texts)} FFN nodes' /metrics"
    loads, seen = [0.0] * n_routed, set()
    for name, text in texts:
        for e, count in expert_tokens(text, name, n_routed).items():
            loads[e] += count
            seen.add(e)
    if sum(loads) <= 0:
        raise UserError(
            f"the metrics {where.removeprefix('from ')} count no expert tokens yet: serve some traffic first"
        )
    unseen = format_experts(set(range(n_routed)) - seen)
    note = f"; expert(s) {unseen} in no metrics, counted 0" if unseen else ""
    return loads, f"{where} ({sum(loads):.0f} token-expert assignments{note})"


def _url(node) -> str:
    host = f"[{node.host}]" if ":" in node.host else node.host
    return f"http://{host}:{node.ports.metrics}/metrics"


def scrape(node, source: str) -> str:

    if node.ports.metrics is None:
        raise UserError(
            f"FFN node {node.name} has no ports.metrics in {source}: its expert loads cannot be read "
            "(add one and restart it, or give --metrics files)"
        )
    try:
        with urllib.request.urlopen(_url(node), timeout=SCRAPE_TIMEOUT) as r:
            return r.read().decode()
    except (OSError, ValueError) as e:  # URLError, timeouts and refusals are OSErrors
        raise UserError(f"FFN node {node.name}: {_url(node)}: {getattr(e, 'reason', None) or e}") from None


def expert_tokens(text: str, where: str, n_routed: int) -> dict[int, float]:
    """{expert: tokens} of one /metrics body (Prometheus text format, as prometheus_client writes it)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[int, float] = {}
    try:
        samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == METRIC]
    except ValueError as e:
        raise UserError(f"{where}: not Prometheus text: {e}") from None
    if not samples:
        raise UserError(f"{where}: no {METRIC} samples: is it an FFN node's /metrics?")
    for s in samples:
        label = s.labels.get("expert", "")
        if not label.isdigit() or int(label) >= n_routed:
            raise UserError(
                f"{where}: {METRIC} with expert={label!r}: not one of the model's {n_routed} (0-{n_routed - 1})"
            )
        out[int(label)] = out.get(int(label), 0.0) + s.value
    return out


def write(cfg, new: Placement, path: str, n_routed: int, groups: int) -> None:
    """The YAML of `cfg` with `new` as layout.placement (and routing attention when it replicates),
    checked to load back into the same config before it replaces `path`."""
    import yaml

    from afd.config.loader import check_expert_layout, from_dict

    routing = "attention" if new.replicated else cfg.layout.routing
    out = dataclasses.replace(cfg, layout=dataclasses.replace(cfg.layout, placement=new.to_yaml(), routing=routing))
    text = out.to_yaml()
    again = from_dict(yaml.safe_load(text), cfg.source)
    if again != out or check_expert_layout(again, n_routed, groups) != new:
        raise RuntimeError(f"the rewritten YAML does not load back into the same placement:\n{text}")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
