"""`afd-attention`: one attention node process."""

from __future__ import annotations

import argparse
import logging
import sys

from afd.node_args import add_dataplane_args, add_model_args, parse_ranks, setup_logging
from afd.signals import exit_on_signal

log = logging.getLogger("afd.attention")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="afd-attention", description="Attention node")
    sub = p.add_subparsers(dest="mode", required=True)
    g = sub.add_parser("generate", help="offline: generate for a prompts file, then leave")
    add_model_args(g)
    add_dataplane_args(g)
    g.add_argument("--prompts-file", required=True, help='JSON {"prompts": [[ids]], "max_tokens": n, ...}')
    g.add_argument("--output-file", required=True)
    add_overlap_args(g)
    return p


def add_overlap_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-overlap", action="store_true", help="wait for each MoE result at once (baseline)")
    p.add_argument("--micro-batches", type=int, default=0, choices=range(5), metavar="{0..4}",
                   help="ping-pong micro-batches per step; 0 (default) chooses from measured times")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("attention", args.rank)
    exit_on_signal()
    from afd.transport import PeerError
    from attention_node.worker import run_offline, set_threads

    set_threads(args.threads)
    try:
        return run_offline(args, parse_ranks(args.peer_ranks))
    except PeerError as e:
        log.error("stopping: %s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
