"""What the benchmark commands' smoke tests share: a tiny LongCat-Flash config and a command's parsed flags."""

from __future__ import annotations

import argparse

from hf_reference import BASE

TINY_LONGCAT = {
    "model_type": "longcat_flash",
    **{k: v for k, v in BASE.items() if k not in ("routed_scaling_factor", "bos_token_id")},
    "max_position_embeddings": 64,
    "eos_token_id": 2,
}
"""hf_reference's tiny LongCat-Flash shape, at the model's default routed scaling."""


def bench_args(module, command: str, argv: list[str]) -> argparse.Namespace:
    """`afd COMMAND ARGV...` parsed by the module's own add_parser, as afd.entrypoints.cli would."""
    parser = argparse.ArgumentParser()
    module.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args([command, *argv])
