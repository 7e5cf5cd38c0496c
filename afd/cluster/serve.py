"""`afd serve MODEL`: one command, as `vllm serve MODEL` — a local cluster for a checkpoint directory
(or `demo`), 1A1F unless told otherwise, or both halves in one process with `--colocated`.

It writes the cluster YAML that `afd launch` would take (127.0.0.1, free internal ports, HTTP ports
from `--port` up) into a private temporary directory and launches it; `--print-config` shows it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import yaml

from afd.cluster.overrides import (
    FOR_ATTENTION,
    FOR_EVERY_NODE,
    DefaultsHelpFormatter,
    add_serving_overrides,
    add_tp_args,
    override_argv,
    parse_bytes_arg,
    positive_int,
    tp_kwargs,
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="serve a model on a local cluster (as `vllm serve MODEL`)", formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("model", help="HF checkpoint directory, or `demo` (the built-in demo checkpoint)")
    p.add_argument("--attention-nodes", type=positive_int, default=None, help="attention node processes (default: 1)")
    p.add_argument(
        "--ffn-nodes",
        type=_count,
        default=None,
        help="FFN node processes (default: 1; 0: the attention nodes run the experts themselves)",
    )
    p.add_argument(
        "--colocated",
        action="store_true",
        help="both halves in one process: no data plane (with --attention-tp N: N processes, each with every expert)",
    )
    p.add_argument(
        "--port", type=int, default=8000, help="HTTP port of the first attention node; the others take the next ones"
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda", "npu"],
        help="device of every node (cuda/npu: node i takes device index i of its role)",
    )
    p.add_argument(
        "--kv-cache-bytes",
        type=parse_bytes_arg,
        default=256 << 20,
        help="KV cache budget per attention node, e.g. 1GiB",
    )
    p.add_argument("--dummy-weights", action="store_true", help="seeded random weights; config.json only")
    p.add_argument("--print-config", action="store_true", help="print the cluster YAML, run nothing")
    add_serving_overrides(p)
    add_tp_args(p)
    p.set_defaults(func=run)


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def cluster_doc(args) -> dict:
    """The cluster YAML of `afd serve`'s flags."""
    from afd.cluster.processes import free_ports

    A = args.attention_nodes or 1
    F = 0 if args.colocated else (1 if args.ffn_nodes is None else args.ffn_nodes)
    tp = tp_kwargs(args)
    G = tp.get("attention_tp", 1)
    internal = iter(free_ports(2 * (A + F) + F))
    nodes = []
    for i in range(A):  # attention node i's TP ranks take devices i*G .. i*G + G - 1
        nodes.append(
            {
                "name": f"attn{i}",
                "role": "attention",
                "host": "127.0.0.1",
                "device": _device(args.device, i * G),
                "ports": {"control": next(internal), "data": next(internal), "http": args.port + i},
            }
        )
    for i in range(F):
        nodes.append(
            {
                "name": f"ffn{i}",
                "role": "ffn",
                "host": "127.0.0.1",
                "device": _device(args.device, A * G + i),
                "ports": {"control": next(internal), "data": next(internal), "metrics": next(internal)},
            }
        )
    model = {"path": args.model, "dtype": args.dtype or "float32", "dummy_weights": args.dummy_weights}
    if args.max_model_len:
        model["max_model_len"] = args.max_model_len
    engine = {"kv_cache_bytes": args.kv_cache_bytes}
    if args.max_num_seqs:
        engine["max_num_seqs"] = args.max_num_seqs
    if args.speculative_tokens:
        engine["speculative_tokens"] = args.speculative_tokens
    doc = {"cluster": {"name": "serve", "coordinator": "attn0"}, "model": model, "engine": engine, "nodes": nodes}
    if args.graph_mode:
        tp = tp | {"graph_mode": args.graph_mode}
    if tp:
        doc["layout"] = tp
    return doc


def _device(kind: str, index: int) -> str:
    return kind if kind == "cpu" else f"{kind}:{index}"


def run(args) -> int:
    if args.colocated and (args.attention_nodes or args.ffn_nodes is not None):
        raise ValueError("--colocated runs both halves in one process; it takes no --attention-nodes or --ffn-nodes")
    if args.model != "demo" and not os.path.isfile(os.path.join(args.model, "config.json")):
        raise ValueError(f"{args.model}: not a checkpoint directory (no config.json), and not `demo`")
    from afd.backend import check_device

    check_device(args.device)
    if args.colocated and (args.attention_tp or 1) == 1:
        from afd.model.tp.config import TPConfig

        # --kvp or --tp-comm without TP ranks: refused here (TPConfigError names the flag's key), not dropped
        TPConfig(1, args.tp_comm or "allreduce", args.flashcomm2_otp, args.tp_comm_min_tokens, args.kvp or 1)
        return _exec_colocated(args)
    doc = cluster_doc(args)
    if args.print_config:
        print(yaml.safe_dump(doc, sort_keys=False), end="")
        return 0
    from afd.cluster import launch

    tmp = tempfile.mkdtemp(prefix="afd-serve-")  # mode 0700: the YAML is this user's
    try:
        path = os.path.join(tmp, "cluster.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(doc, f, sort_keys=False)
        args.config = path
        args.model, args.port, args.print_commands, args.curl_example = None, None, False, True
        return launch.run(args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _exec_colocated(args) -> int:
    """Replaces this process with the colocated server: one process, as the flag promises."""
    argv = [
        sys.executable,
        "-m",
        "attention_node.main",
        "colocated",
        "--model",
        args.model,
        "--device",
        args.device,
        "--port",
        str(args.port),
        "--kv-cache-bytes",
        str(args.kv_cache_bytes),
        *override_argv(args, FOR_EVERY_NODE + FOR_ATTENTION),
    ]
    if args.dummy_weights:
        argv.append("--dummy-weights")
    if args.print_config:
        print(" ".join(argv[1:]))
        return 0
    if args.api_key:
        os.environ["AFD_API_KEY"] = args.api_key
    sys.stdout.flush()
    os.execv(sys.executable, argv)
    return 0  # not reached
