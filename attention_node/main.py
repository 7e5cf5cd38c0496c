"""`afd-attention`: one attention node process.

afd-attention --config cluster.yaml --node attn0 [--model PATH] [--port N] [--api-key KEY]
afd-attention generate --config cluster.yaml --node attn0 --prompts-file F --output-file O   (offline;
    F may be a job mailbox directory instead: afd.cluster.jobs)
afd-attention colocated --model PATH [--port N] ...   (both halves in this process: `afd serve --colocated`)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from afd.node.args import add_cluster_args, add_engine_args, start_cluster_node
from afd.node.signals import exit_on_signal

log = logging.getLogger("afd.attention")


def build_server_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="afd-attention",
        description="Attention node: OpenAI API, scheduler, "
        "KV cache and the attention half of every layer. (`afd-attention generate "
        "--help`: the offline worker.)",
    )
    add_cluster_args(p)
    p.add_argument(
        "--tp-rank",
        type=int,
        default=0,
        help="this process's TP rank in the node (layout.attention_tp); ranks > 0 follow rank 0, which serves the API",
    )
    p.add_argument("--model", default=None, help="override the YAML's model path")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--host",
        default=None,
        help="address the HTTP API listens on (default: --bind-host); e.g. 0.0.0.0 to serve other hosts",
    )
    p.add_argument("--port", type=int, default=None, help="override this node's HTTP port")
    p.add_argument("--api-key", default=os.environ.get("AFD_API_KEY"), help="require Bearer KEY on /v1 routes")
    add_engine_args(p)
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=None,
        help="seconds SIGTERM lets running requests finish (0 aborts them)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads (0: the YAML's, else the host's cores split among its CPU nodes)",
    )
    return p


def build_generate_parser() -> argparse.ArgumentParser:
    g = argparse.ArgumentParser(
        prog="afd-attention generate",
        description="offline: a node of the cluster YAML that generates for a prompts file, then leaves",
    )
    add_cluster_args(g)
    g.add_argument("--model", default=None, help="override the YAML's model path")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    g.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: as for serving)")
    g.add_argument("--prompts-file", required=True, help='JSON {"prompts": [[ids]], "max_tokens": n, ...}')
    g.add_argument("--output-file", default=None, help="where rank 0 writes the outputs (required there)")
    g.add_argument("--tp-rank", type=int, default=0, help="this process's TP rank in the node (layout.attention_tp)")
    return g


def main(argv: list[str] | None = None) -> int:
    exit_on_signal()  # first: torch and grpc start threads at import, and threads inherit the mask
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "generate":
        return _exit_now(_run_generate(build_generate_parser().parse_args(argv[1:])))
    if argv and argv[0] == "colocated":
        from attention_node import colocated

        return colocated.run(colocated.build_parser().parse_args(argv[1:]))
    args = build_server_parser().parse_args(argv)
    if not args.config:
        print("afd-attention: error: --config FILE --node NAME is required (or the `generate` mode)", file=sys.stderr)
        return 2
    if args.tp_rank:
        from attention_node.tp_rank import run_tp_rank

        return _exit_now(run_tp_rank(args))
    from attention_node.cluster_mode import run_cluster_node

    return run_cluster_node(args)


def _run_generate(args) -> int:
    cfg = start_cluster_node(args, "attention")
    if isinstance(cfg, int):
        return cfg
    from afd.node.process import run_node
    from attention_node.tp_rank import check_tp_rank
    from attention_node.worker import OfflineNode

    one_job = not os.path.isdir(args.prompts_file)  # else a local cluster's mailbox (afd.cluster.jobs)
    need_output = one_job and not args.tp_rank and not args.output_file
    missing = None if os.path.exists(args.prompts_file) else f"--prompts-file {args.prompts_file}: no such file"
    err = check_tp_rank(cfg, args) or missing or ("--output-file is required" if need_output else None)
    if err:
        print(f"afd-attention generate: error: {err}", file=sys.stderr)
        return 2
    return run_node(OfflineNode(cfg, args, args.tp_rank), log)


def _exit_now(code: int) -> int:
    """Ends a process whose work is done (its data plane closed, or a TP rank's left to rank 0), skipping
    interpreter teardown:
    there, a destroyed process group's gloo threads can still be joinable, and C++ aborts the process
    ("terminate called without an active exception", exit -6) after a clean run (seen on a TP rank)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
