"""`afd simulate` and `afd plan`: the simulator and the search on a measured profile (`afd profile`'s JSON)
or on a hardware spec's roofline (`--hardware a3|h200|FILE`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from afd.config.fieldspec import at_least
from afd.config.flags import DefaultsHelpFormatter, config_flags
from afd.errors import UserError

HEADROOM = 0.9
"""Share of a device's memory weights and KV cache may fill: the rest is activations, buffers, the runtime."""
DEVICE_OF = {"a3": "npu", "h200": "cuda"}
"""The device type of a shipped spec's cluster YAML (another spec file's: cuda)."""


def _add_source(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="a cost model measured by `afd profile` (JSON)")
    src.add_argument("--hardware", help="a hardware spec: a3, h200, or a spec file (afd/plan/specs/)")
    p.add_argument("--context", type=at_least(0), default=4096, help="KV positions per sequence (--hardware)")
    config_flags()["quantization"].add_to(p, help="fp8, w8a8 or w8a16 weights (--hardware)")
    p.add_argument(
        "--launch-us",
        type=float,
        default=None,
        help="seconds per kernel launch, in us (graph mode: ~1; default: the spec's eager launch)",
    )


def add_parsers(sub) -> None:
    """`afd profile`, `afd simulate`, `afd plan`."""
    from afd.plan import profile

    profile.add_parser(sub)
    s = sub.add_parser("simulate", help="predict a cluster YAML's decode step", formatter_class=DefaultsHelpFormatter)
    s.add_argument("config", help="cluster YAML")
    _add_source(s)
    s.add_argument("--batch", type=at_least(1), required=True, help="sequences per attention node (at least 1)")
    config_flags()["micro_batches"].add_to(s, help="1..4; default: the YAML's")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=run_simulate)
    p = sub.add_parser(
        "plan",
        help="search AFD layouts for the most tokens/s per device under a TPOT SLO",
        formatter_class=DefaultsHelpFormatter,
    )
    config_flags()["model"].add_to(p, required=True, help="checkpoint directory, hub name or `demo`")
    _add_source(p)
    p.add_argument("--tpot-slo", type=float, required=True, help="time per output token, in ms")
    p.add_argument("--devices", type=at_least(2), default=8, help="devices at most (at least 2)")
    config_flags()["dtype"].add_to(p, help="default: the checkpoint's")
    p.add_argument("--top", type=at_least(1), default=10, help="plans printed (at least 1)")
    p.add_argument("--output", default=None, help="write the best plan as a cluster YAML here")
    p.set_defaults(func=run_plan)


class _Source:
    """The cost model of a layout: the profile's (one measured model) or the spec's roofline (per layout)."""

    def __init__(self, args, model_cfg, model: str, dtype: str):
        from afd.plan.costs import CostModel

        self.profile = CostModel.from_json(Path(args.profile).read_text()) if args.profile else None
        self.spec = None
        if args.hardware:
            from afd.plan.hardware import load_spec

            self.spec = load_spec(args.hardware)
            if dtype == "float32" and not any(d == "fp32" for d, _ in self.spec.compute):
                print(f"({model}: float32 checkpoint, costed in bfloat16: {self.spec.name} has no fp32 peak)")
                dtype = "bfloat16"  # an accelerator serves it in 16 bits
        self.args, self.model_cfg, self.model, self.dtype = args, model_cfg, model, dtype
        self._rooflines: dict = {}
        self._models: dict = {}

    def roofline(self, tp: int, f: int, routing: str):
        from afd.plan.roofline import roofline

        key = (tp, f, routing)
        if key not in self._rooflines:
            launch = None if self.args.launch_us is None else self.args.launch_us * 1e-6
            assert self.spec is not None
            self._rooflines[key] = roofline(
                self.spec,
                self.model_cfg,
                model=self.model,
                dtype=self.dtype,
                quantization=self.args.quantization,
                context=self.args.context,
                attn_tp=tp,
                ffn_nodes=f,
                routing=routing,
                launch=launch,
            )
        return self._rooflines[key]

    def tp_sizes(self) -> tuple[int, ...]:
        """Attention TP sizes to search: a profile's own (its attention costs were measured at that TP only),
        else each that divides the heads."""
        if self.profile is not None:
            return (self.profile.attention_tp,)
        from afd.model.registry import family

        if not family(self.model_cfg.model_type).attention_half.supports_tp:  # Qwen3-MoE's GQA half
            return (1,)
        return tuple(t for t in (1, 2, 4, 8) if self.model_cfg.num_attention_heads % t == 0)

    def costs(self, layout):
        """The layout's cost model: the profile's, or the roofline linearised at the layout's own tokens per
        micro-batch and the rows they put on one FFN node (half to twice each)."""
        tp, f, routing = layout.attention_tp, layout.ffn_nodes, layout.routing
        if self.profile is not None:
            if tp != self.profile.attention_tp:
                raise UserError(
                    f"attention_tp {tp}: the profile ({self.profile.source}) was measured at attention_tp "
                    f"{self.profile.attention_tp}; profile a cluster at {tp} or use --hardware"
                )
            return self.profile
        r = self.roofline(tp, f, routing)
        t = max(1.0, layout.batch / layout.micro_batches)
        rows = layout.attention_nodes * t * r.rows_per_token  # every attention node's rows reach each FFN node
        key = (tp, f, routing, layout.attention_nodes, t)
        if key not in self._models:
            self._models[key] = r.cost_model(tokens=(t / 2, t, 2 * t), rows=(rows / 2, rows, 2 * rows))
        return self._models[key]

    def memory(self, layout) -> dict[str, float] | None:
        """Bytes per device by role, None when they exceed the spec's capacity; {} for a profile (the machine it
        was measured on held the model)."""
        if self.spec is None:
            return {}
        r = self.roofline(layout.attention_tp, layout.ffn_nodes, layout.routing)
        cfg = self.model_cfg
        moe, dense = len(cfg.moe_layers), cfg.num_layers - len(cfg.moe_layers)
        attn_w = moe * sum(r.held_bytes(p) for p in ("attn_pre", "attn_window", "attn_post"))
        attn_w += dense * r.held_bytes("dense") + r.held_bytes("step")
        from afd.model.state_spec import state_bytes_per_token, window_bytes_per_sequence

        b = 4 if self.dtype == "float32" else 2
        # every rank keeps its sequences' whole state (MLA latents; V4's compressed entries and its window)
        kv = layout.batch * (self.args.context * state_bytes_per_token(cfg, b) + window_bytes_per_sequence(cfg, b))
        need = {"attention": attn_w + kv, "ffn": moe * r.held_bytes("ffn")}
        cap = HEADROOM * self.spec.memory_capacity
        return need if max(need.values()) <= cap else None


def _model(path: str, dtype: str | None):
    from afd.cluster.topology import resolve_model_path
    from afd.model.config import checkpoint_dtype, read_config_json
    from afd.model.registry import config_from_hf

    d = read_config_json(resolve_model_path(path))
    return config_from_hf(d), dtype or checkpoint_dtype(d)


def run_simulate(args) -> int:
    from afd.cluster.topology import with_model_defaults
    from afd.config.loader import load
    from afd.plan.scenario import Scenario
    from afd.plan.shape import Layout, ModelShape
    from afd.plan.simulate import simulate

    cfg = load(args.config)
    model_cfg, dtype = _model(cfg.model.path, None if cfg.model.dtype == "auto" else cfg.model.dtype)
    cfg = with_model_defaults(cfg)  # an unset routing, as the nodes would run it
    shape = ModelShape.from_config(model_cfg, dtype, cfg.model.path)
    src = _Source(args, model_cfg, cfg.model.path, dtype)
    layout = Layout.from_cluster(cfg, args.batch, args.micro_batches or None)
    costs = src.costs(layout)
    pred = simulate(Scenario.from_cluster(cfg, shape, costs, args.batch, args.micro_batches or None))
    out = pred.to_dict() | {"source": costs.source}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{args.config} at {args.batch} sequences per attention node ({costs.source}):")
        for k in ("step_time", "attention_busy", "attention_wait", "ffn_busy", "link_busy"):
            print(f"  {k:<24} {out[k] * 1e3:>10.3f} ms")
        print(f"  {'bottleneck':<24} {out['bottleneck']:>10}")
        print(f"  {'tokens/s per device':<24} {out['tokens_per_s_per_device']:>10.1f}")
        if note := shared_host_note(layout, costs):
            print(note)
    return 0


def run_plan(args) -> int:
    from afd.plan.search import Space, no_plan, search, table
    from afd.plan.shape import ModelShape

    if not args.tpot_slo > 0:
        raise UserError(f"--tpot-slo {args.tpot_slo}: a time per output token in ms, above 0")
    args.dtype = None if args.dtype == "auto" else args.dtype
    model_cfg, dtype = _model(args.model, args.dtype)
    shape = ModelShape.from_config(model_cfg, dtype, args.model)
    src = _Source(args, model_cfg, args.model, dtype)
    tp = src.tp_sizes()
    xd = ("same",) if src.profile is not None or args.quantization is None else ("same", "fp8")
    # a router that reads the token ids (DeepSeek-V4's hash layers) runs where they are: on the attention side
    routings = ("attention",) if model_cfg.routes_by_token_ids else Space.routings
    space = Space(args.devices, tp_sizes=tp, routings=routings, exchange_dtypes=xd)
    plans, misses = search(shape, src.costs, space, args.tpot_slo * 1e-3, src.memory)
    if not plans:
        raise UserError(no_plan(misses, args.tpot_slo * 1e-3))
    spec_name = src.spec.name if src.spec is not None else ""
    source = src.profile.source if src.profile is not None else f"hardware {spec_name} (roofline: a lower bound)"
    print(f"{args.model} on at most {args.devices} devices, TPOT <= {args.tpot_slo:g} ms; costs: {source}")
    print(table(plans, args.top))
    if src.profile is not None:
        print("(memory per device not checked: a profile's costs come from a machine that held the model)")
        if note := shared_host_note(plans[0].layout, src.profile):
            print(note)
    if args.output:
        _write(plans[0], args, src)
        print(f"best plan written to {args.output} (afd check-config {args.output})")
    return 0


def shared_host_note(layout, costs) -> str:
    """A caution where a layout puts more node processes on a profile's host than it has cores. The simulator
    shares the cores as processor sharing does, which holds for the compute itself, but not what the sharing
    costs (wake-ups waiting for a core, the transport threads, colder caches): `afd bench-plan` measured 2A1F
    with overlap, three processes on two cores, at 1.06-1.43 times its predicted step
    (docs/benchmarks/planner.md)."""
    processes = layout.attention_ranks + layout.ffn_nodes
    if not costs.host_cores or processes <= costs.host_cores:
        return ""
    return (
        f"(caution: {processes} node processes on the host's {costs.host_cores} core"
        f"{'s' if costs.host_cores > 1 else ''}; where processes outnumbered the cores, measured steps ran up to"
        " 1.4x the prediction: docs/benchmarks/planner.md)"
    )


def _write(plan, args, src) -> None:
    from afd.cluster.local_config import local_config

    lay = plan.layout
    device = "cpu" if src.spec is None else DEVICE_OF.get(src.spec.name, "cuda")
    layout = {"attention_tp": lay.attention_tp, "micro_batches": lay.micro_batches, "routing": lay.routing}
    if lay.exchange_dtype != "same":
        layout["exchange_dtype"] = lay.exchange_dtype
    model = {"path": args.model} | ({"dtype": args.dtype} if args.dtype else {})
    model |= {"quantization": args.quantization} if args.quantization else {}
    sections = {"model": model, "layout": layout, "engine": {"max_num_seqs": lay.batch}}
    cfg = local_config(lay.attention_nodes, lay.ffn_nodes, sections, name="planned", device=device)
    Path(args.output).write_text(cfg.to_yaml())
