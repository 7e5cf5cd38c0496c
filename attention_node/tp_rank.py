"""`afd-attention --config F --node N --tp-rank R`: TP rank R > 0 of a serving attention node.

It registers with the control plane as `N.tpR`, takes its rank in the data plane, holds its share of
the attention half and a KV cache like rank 0's, and runs what rank 0 sends (afd.engine.runner.follow):
every step, idle step and the final leave. It serves no port of its own; it exits when rank 0 leaves,
and with an error when rank 0 (or the data plane) is gone.
"""

from __future__ import annotations

import logging
import threading

from afd.control.client import ControlError
from afd.dataplane.transport import PeerError
from afd.engine.graph import settings_of, wrap
from afd.engine.runner import ModelRunner, follow
from afd.model.config import parse_dtype
from afd.node.args import start_cluster_node
from afd.node.runtime import bring_up
from afd.node.signals import set_stop_handler
from attention_node.halves import build_rank, exchange, load_halves
from attention_node.setup import kv_cache_for

log = logging.getLogger("afd.attention")


def check_tp_rank(cfg, args) -> str | None:
    tp = cfg.layout.attention_tp
    if not 0 <= args.tp_rank < tp:
        return (
            f"{cfg.source}: --tp-rank {args.tp_rank}: node {args.node} has TP ranks 0..{tp - 1} "
            f"(layout.attention_tp {tp})"
        )
    return None


def run_tp_rank(args) -> int:
    cfg = start_cluster_node(args, "attention")
    if isinstance(cfg, int):
        return cfg
    err = check_tp_rank(cfg, args)
    if err:
        log.error("%s", err)
        return 2
    box: dict = {"done": threading.Event()}
    set_stop_handler(lambda _: _stop(box, cfg.engine.shutdown_timeout + 10))
    dtype = parse_dtype(cfg.model.dtype)
    built: list = []
    try:
        rt = bring_up(
            cfg, args.node, args.bind_host, lambda rt: built.append(load_halves(rt, dtype)), tp_rank=args.tp_rank
        )
    except (ControlError, PeerError, OSError, ValueError) as e:
        log.error("startup failed: %s", e)
        return 1
    box["runtime"] = rt
    try:
        attn, tp, moe = build_rank(rt, built[0], dtype)
        kv = kv_cache_for(rt.model_cfg, dtype, rt.backend.device, cfg.engine, tp.cfg.kvp)
        attn = wrap(attn, kv, settings_of(cfg), tp, rt.backend)  # under TP: eager, said once (afd.engine.graph)
        runner = ModelRunner(attn, moe, kv, rt.backend.device, cfg.layout.micro_batches, cfg.layout.overlap, tp)
        rt.backend.bind_thread()
        log.info("TP rank %d of %s ready", args.tp_rank, args.node)
        box["following"] = True
        _follow(rt, runner, tp, built[0], dtype)
    except Exception as e:  # noqa: BLE001 (PeerError and TPError; also a failed re-forming, ControlError, or a
        # layout the rank cannot cut, ValueError): one line and exit code 1, through main's _exit_now either way
        log.error("stopping: %s: %s", type(e).__name__, e)
        return 1
    finally:
        box["done"].set()
        rt.close(plane=False)
    return 0


def _follow(rt, runner: ModelRunner, tp, built, dtype) -> None:
    """Follows rank 0 until it leaves for good. When the data plane fails (a peer died) or rank 0 moves
    to the next generation, this rank re-forms with it, as rank 0's engine does, and follows on: rank 0
    runs the interrupted step again."""
    can_rejoin = rt.cfg.cluster.rejoin_timeout > 0
    while True:
        try:
            msg = follow(runner)
            if not msg[2]:  # a plain leave: the node is done
                return
            why = "rank 0 moves to the next data-plane generation"
        except PeerError as e:
            if not can_rejoin:
                raise
            why = str(e)  # leave the except block first: its traceback pins the old process group
        runner.moe = None
        rt.reform(why)
        tp.connect()
        runner.moe = exchange(rt, built, dtype)
        log.info("TP rank %d re-formed with data-plane generation %d", rt.tp_rank, rt.plane.generation)


def _stop(box: dict, grace: float) -> None:
    """SIGTERM (a pod's ranks all get it at once): rank 0 drains its requests and then leaves, which
    ends this rank's loop; the process exits then, or after the drain's grace if that never comes."""
    if box.get("following") and not box["done"].wait(grace):
        log.warning("rank 0 did not leave within %.0fs of SIGTERM; exiting", grace)
    rt = box.get("runtime")
    if rt is not None:
        rt.close(plane=False)
