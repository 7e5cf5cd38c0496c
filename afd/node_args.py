"""Command-line flags shared by the node commands and the local launcher."""

from __future__ import annotations

import argparse
import logging


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", required=True, help="HF checkpoint directory")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda", "npu"])
    g.add_argument("--device-index", type=int, default=0)
    g.add_argument("--dummy-weights", action="store_true", help="seeded random weights; config.json only")
    g.add_argument("--seed", type=int, default=0, help="seed of --dummy-weights")
    g.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")


def add_dataplane_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data plane")
    g.add_argument("--rank", type=int, required=True)
    g.add_argument("--world-size", type=int, required=True)
    g.add_argument("--master-addr", default="127.0.0.1")
    g.add_argument("--master-port", type=int, required=True)
    g.add_argument("--peer-ranks", required=True, help="comma-separated data-plane ranks of the other role")
    g.add_argument("--comm-timeout", type=float, default=60.0, help="seconds any data-plane wait may take")


def parse_ranks(s: str) -> list[int]:
    try:
        ranks = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--peer-ranks: expected comma-separated integers, got {s!r}") from None
    if not ranks:
        raise SystemExit("--peer-ranks: no ranks given")
    return ranks


def setup_logging(role: str, rank: int) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role}[{rank}] %(levelname)s %(message)s")
