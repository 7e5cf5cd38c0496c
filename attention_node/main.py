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

from afd.config.flags import DefaultsHelpFormatter, add_flags
from afd.errors import UserError
from afd.node.args import add_cluster_args, start_cluster_node
from afd.node.signals import exit_on_signal

log = logging.getLogger("afd.attention")


def build_server_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="afd-attention",
        formatter_class=DefaultsHelpFormatter,
        description="Attention node: OpenAI API, scheduler, "
        "KV cache and the attention half of every layer. (`afd-attention generate "
        "--help`: the offline worker.)",
    )
    add_cluster_args(p)
    add_flags(p, "tp_rank", "host", "port", "api_key")
    return p


def build_generate_parser() -> argparse.ArgumentParser:
    g = argparse.ArgumentParser(
        prog="afd-attention generate",
        formatter_class=DefaultsHelpFormatter,
        description="offline: a node of the cluster YAML that generates for a prompts file, then leaves",
    )
    add_cluster_args(g)
    add_flags(g, "tp_rank")
    g.add_argument("--prompts-file", required=True, help='JSON {"prompts": [[ids]], "max_tokens": n, ...}')
    g.add_argument("--output-file", default=None, help="where rank 0 writes the outputs (required there)")
    return g


def main(argv: list[str] | None = None) -> int:
    exit_on_signal()  # first: torch and grpc start threads at import, and threads inherit the mask
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _dispatch(argv)
    except UserError as e:  # the YAML, the node's device, a port taken: said before anything starts
        print(f"afd-attention: error: {e}", file=sys.stderr)
        return 2


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] == "generate":
        return _exit_now(_run_generate(build_generate_parser().parse_args(argv[1:])))
    if argv and argv[0] == "colocated":
        from attention_node import colocated

        return colocated.run(colocated.build_parser().parse_args(argv[1:]))
    args = build_server_parser().parse_args(argv)
    if not args.config:
        raise UserError("--config FILE --node NAME is required (or the `generate` mode)")
    if args.tp_rank:
        from attention_node.tp_rank import run_tp_rank

        return _exit_now(run_tp_rank(args))
    from attention_node.cluster_mode import run_cluster_node

    return run_cluster_node(args)


def _run_generate(args) -> int:
    cfg = start_cluster_node(args, "attention")
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
