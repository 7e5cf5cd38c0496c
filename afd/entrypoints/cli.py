"""`afd` command line: subcommands register themselves from small modules."""

from __future__ import annotations

import argparse
import json
import os
import sys

from afd.config.flags import DefaultsHelpFormatter, add_config_flags, add_flags, overrides_of
from afd.control.cluster_client import cluster_status, drain
from afd.errors import UserError


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate", help="offline generation from token ids (greedy by default)", formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("--prompt-ids", required=True, help="JSON file: a list of token-id lists")
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    add_flags(p, "device", "colocated", "attention_nodes", "ffn_nodes")
    add_config_flags(p)
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args) -> int:
    from afd.backend.devices import check_device

    if not args.model:
        raise UserError("--model is required (an HF checkpoint directory, or `demo`)")
    if args.colocated and (args.attention_nodes is not None or args.ffn_nodes is not None):
        raise UserError("--colocated runs both halves in this process; it takes no --attention-nodes or --ffn-nodes")
    try:
        with open(args.prompt_ids) as f:
            prompts = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"--prompt-ids {args.prompt_ids}: {e}") from None
    options = {k: v for values in overrides_of(args).values() for k, v in values.items() if k != "path"}
    # --seed seeds sampling, as in serve (engine.sampling_seed); --weights-seed the dummy weights (model.seed)
    if "seed" in options:
        options["weights_seed"] = options.pop("seed")
    seed = options.get("sampling_seed")
    if not args.colocated:  # node processes: the micro-batch count is measured unless given (colocated: 1)
        A, F = args.attention_nodes or 1, 1 if args.ffn_nodes is None else args.ffn_nodes
        options = {"micro_batches": 0, **options, "attention_nodes": A, "ffn_nodes": F}
    check_device(args.device)  # before torch's import (seconds): a bad flag or device is refused at once
    from afd.entrypoints.llm import LLM

    llm = LLM(args.model, device=args.device, **options)
    # every prompt's sampling seeded with --seed, as a request's own seed: the same tokens colocated or on nodes
    out = llm.generate_ids(
        prompts, args.max_tokens, temperature=args.temperature, seed=seed, ignore_eos=args.ignore_eos, progress=True
    )
    print(json.dumps(out))
    return 0


def _add_check_config(sub) -> None:
    p = sub.add_parser("check-config", help="validate a cluster YAML and print the resolved topology")
    p.add_argument("config")
    p.set_defaults(func=_cmd_check_config)


def _cmd_check_config(args) -> int:
    from afd.cluster.topology import describe, local_model
    from afd.config.loader import check_expert_layout, load

    cfg, model_cfg = local_model(load(args.config))
    placement = None
    if model_cfg is not None:
        placement = check_expert_layout(cfg, model_cfg.n_routed_experts, model_cfg.expert_groups[0])
    print(describe(cfg, placement))
    if model_cfg is None:
        print(f"(model {cfg.model.path} not readable here: the placement resolves at startup)")
    if placement is not None and model_cfg is not None:  # the MoE exchange's bytes, by formula
        from afd.dataplane.wire_cost import exchange_report

        print(exchange_report(cfg, model_cfg, placement))
    if getattr(cfg.layout, "attention_tp", 1) > 1:  # bytes per TP rank and layer, by formula
        from afd.model.tp.volume import check_config_report

        print(check_config_report(cfg, model_cfg))
    return 0


def _add_env(sub) -> None:
    p = sub.add_parser(
        "env", help="this machine's CPU, torch, and the GEMM kernels afd chose here by timing (the kernel cache)"
    )
    p.add_argument("--json", action="store_true", help="print it as JSON")
    p.set_defaults(func=_cmd_env)


def _cmd_env(args) -> int:
    import json

    from afd.backend.kernel_choice import environment

    env = environment()
    if args.json:
        print(json.dumps(env, indent=1))
        return 0
    for key in ("machine", "cpu", "cpu_flags", "torch", "threads", "int_mm_exact", "kernel_cache"):
        print(f"{key}: {env[key]}")
    kernels = env["kernels"]
    print(f"kernels chosen on this machine: {len(kernels)}" + ("" if kernels else " (none yet: serve a model)"))
    for label, entry in sorted(kernels.items()):
        timed = ", ".join(f"{k} {v:.3f} ms" for k, v in sorted(entry.get("medians_ms", {}).items()))
        print(f"  {label}: {entry.get('kernel')}" + (f" ({timed})" if timed else ""))
    return 0


def _add_status(sub) -> None:
    p = sub.add_parser("status", help="ask a running cluster's coordinator for its state")
    p.add_argument("config", help="cluster YAML")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.set_defaults(func=_cmd_status)


def _cmd_status(args) -> int:
    from google.protobuf.json_format import MessageToDict

    from afd.config.loader import load
    from afd.control import control_pb2 as pb

    cfg = load(args.config)
    st = cluster_status(cfg)
    unserved = _unserved_experts(cfg, set(st.lost) | set(st.missing))
    if args.json:
        doc = MessageToDict(st, always_print_fields_with_no_presence=True)
        print(json.dumps({**doc, "unserved_experts": unserved}))
    else:
        print(
            f"cluster {cfg.cluster.name} ({cfg.topology_name}): {pb.ClusterStatus.State.Name(st.state)}"
            + (f" — {st.message}" if st.message else "")
        )
        for key in ("registered", "ready", "missing", "lost", "draining"):
            print(f"  {key:<10} {', '.join(getattr(st, key)) or '-'}")
        if unserved is not None:
            from afd.config.placement import format_experts

            print(f"  {'unserved':<10} {format_experts(unserved) or '-'} (routed experts no live FFN node holds)")
    return 0 if st.state in (pb.ClusterStatus.READY, pb.ClusterStatus.DRAINING) else 1


def _unserved_experts(cfg, down: set[str]) -> list[int] | None:
    """Routed experts that no FFN node outside `down` holds (their tokens wait for a replacement); None where
    the cluster has no FFN nodes or the model is not readable here."""
    from afd.cluster.topology import local_model

    model_cfg = None if cfg.colocated else local_model(cfg)[1]
    if model_cfg is None:
        return None
    placement = cfg.placement(model_cfg.n_routed_experts, model_cfg.expert_groups[0])
    return placement.unserved({n for n in down if n in placement.nodes})


def _add_drain(sub) -> None:
    p = sub.add_parser("drain", help="tell attention nodes to take no new requests and finish running ones")
    p.add_argument("config", help="cluster YAML")
    add_flags(p, "node", help="the attention node to drain (default: all of them)")
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="S",
        help="then wait up to S seconds for its running requests to finish (default: 0, do not wait)",
    )
    p.set_defaults(func=_cmd_drain)


def _cmd_drain(args) -> int:
    import time

    from afd.config.loader import load

    cfg = load(args.config)
    if args.node is not None and args.node not in [n.name for n in cfg.attention_nodes]:
        raise UserError(f"--node {args.node}: not an attention node of {args.config}")
    drain(cfg, args.node)
    nodes = [cfg.node(args.node)] if args.node else cfg.attention_nodes
    print(f"draining {', '.join(n.name for n in nodes)}")
    deadline = time.monotonic() + args.wait
    while args.wait > 0:
        running = sum(_running_requests(cfg, n) for n in nodes)
        if running == 0:
            print("no request running")
            return 0
        if time.monotonic() > deadline:
            print(f"{running} request(s) still running after {args.wait:g}s")
            return 1
        time.sleep(0.5)
    return 0


def _running_requests(cfg, node) -> int:
    """Running + waiting requests of an attention node, from its /metrics (0 once it is gone); over https when
    the YAML gives http.ssl_certfile."""
    from afd.cluster.api_client import api_url, open_api

    try:
        with open_api(api_url(cfg.http, node.host, node.ports.http) + "/metrics", cfg.http, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return 0
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("afd_num_requests_running{", "afd_num_requests_waiting{")):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """`afd` and its subcommands' parsers."""
    parser = argparse.ArgumentParser(prog="afd", description="Attention-FFN Disaggregated MoE serving")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_check_config(sub)
    _add_env(sub)
    _add_status(sub)
    _add_drain(sub)
    from afd.bench import dispatch, graph, mtp, paged, plan_check, quant, serve, step, suite, tp
    from afd.entrypoints import launch, prometheus_config, rebalance
    from afd.entrypoints import serve as serve_model

    for module in (
        serve_model,
        launch,
        prometheus_config,
        serve,
        step,
        suite,
        tp,
        graph,
        mtp,
        paged,
        quant,
        dispatch,
        plan_check,
    ):
        module.add_parser(sub)
    rebalance.add_parser(sub)
    from afd.entrypoints import plan

    plan.add_parsers(sub)
    return parser, sub


def main(argv: list[str] | None = None) -> int:
    parser, sub = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the subcommand's usage, not afd's, and vLLM's flags named with afd's equivalent
        from afd.cluster.vllm_flags import refusal

        sub.choices[args.command].error(refusal(extra))
    from afd.cluster.link import LinkError
    from afd.cluster.local import ClusterError  # light: no torch

    try:
        return args.func(args)
    except (UserError, ValueError, ClusterError, LinkError) as e:  # ValueError: ConfigError, CheckpointError, ...
        print(f"afd {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`afd env | head`): nothing more to say, and no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush would raise it again
        return 1


def _version() -> str:
    from afd import __version__

    return __version__


if __name__ == "__main__":
    sys.exit(main())
