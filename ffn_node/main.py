"""`afd-ffn --config cluster.yaml --node ffn0`: one FFN node of a cluster YAML."""

from __future__ import annotations

import argparse
import sys

from afd.config.flags import DefaultsHelpFormatter
from afd.errors import UserError
from afd.node.args import add_cluster_args
from afd.node.signals import exit_on_signal


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="afd-ffn",
        formatter_class=DefaultsHelpFormatter,
        description="FFN node: serves the MoE half of every layer for the attention nodes of its cluster",
    )
    add_cluster_args(p)
    p.add_argument("--report-file", default=None, help="at exit, write steps, tokens and compute/idle seconds")
    return p


def main(argv: list[str] | None = None) -> int:
    exit_on_signal()  # first: torch and grpc start threads at import, and threads inherit the mask
    args = build_parser().parse_args(argv)
    if not args.config or not args.node:
        print("afd-ffn: error: --config FILE and --node NAME are required", file=sys.stderr)
        return 2
    from ffn_node.cluster_mode import run_cluster_node

    try:
        return run_cluster_node(args)
    except UserError as e:  # the YAML, the node's device, a port taken: said before anything starts
        print(f"afd-ffn: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
