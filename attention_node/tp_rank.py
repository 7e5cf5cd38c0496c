"""`afd-attention --config F --node N --tp-rank R`: TP rank R > 0 of a serving attention node.

It registers with the control plane as `N.tpR`, takes its rank in the data plane, holds its share of
the attention half and a KV cache like rank 0's, and runs what rank 0 sends (afd.engine.runner.follow):
every step, idle step and the final leave. It serves no port of its own; it exits when rank 0 leaves,
and with an error when rank 0 (or the data plane) is gone.
"""

from __future__ import annotations

import logging
import threading

from afd.dataplane.transport import PeerError
from afd.engine.factory import build_runner
from afd.engine.runner import ModelRunner, follow
from afd.node.args import start_cluster_node
from afd.node.process import run_node
from attention_node.node import AttentionNode

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
    err = check_tp_rank(cfg, args)
    if err:
        log.error("%s", err)
        return 2
    return run_node(TPRankNode(cfg, args), log)


class TPRankNode(AttentionNode):
    """TP rank R > 0 of a serving attention node: a KV cache like rank 0's, and a runner that runs what
    rank 0 sends."""

    def __init__(self, cfg, args):
        super().__init__(cfg, args, args.tp_rank)
        self.runner: ModelRunner | None = None
        self.following = False
        self.done = threading.Event()
        """Set once the rank stopped following (rank 0 left, or it failed)."""

    def start(self) -> None:
        super().start()
        rt = self.rt  # a KV cache like rank 0's: block tables come from the leader
        self.runner = build_runner(self.cfg, self.half, self.moe, rt.backend.device, tp=self.tp, backend=rt.backend)

    def serve(self) -> int:
        self.rt.backend.bind_thread()
        log.info("TP rank %d of %s ready", self.tp_rank, self.args.node)
        self.following = True
        try:
            self._follow()
        except Exception as e:  # noqa: BLE001 (PeerError and TPError; also a failed re-forming, ControlError):
            # one line and exit code 1, through main's _exit_now either way
            log.error("stopping: %s: %s", type(e).__name__, e)
            return 1
        finally:
            self.done.set()
            self.rt.close(plane=False)
        return 0

    def _follow(self) -> None:
        """Follows rank 0 until it leaves. When the data plane fails (a peer died, or rank 0 re-forms and
        drops its TP groups), this rank forms its own pairs again, as rank 0's engine does, and follows
        on: rank 0 runs the interrupted step again."""
        can_rejoin = self.cfg.cluster.rejoin_timeout > 0
        runner = self.runner
        assert runner is not None  # set by start()
        while True:
            try:
                follow(runner)
                return  # rank 0 left: the node is done
            except PeerError as e:
                if not can_rejoin:
                    raise
                why = str(e)  # leave the except block first: its traceback pins the old process group
            runner.moe = None
            runner.moe = self.reform(why)
            log.info("TP rank %d formed its pairs again", self.tp_rank)

    def stop(self) -> None:
        """SIGTERM (a pod's ranks all get it at once): rank 0 drains its requests and then leaves, which
        ends this rank's loop; the process exits then, or after the drain's grace if that never comes."""
        grace = self.cfg.engine.shutdown_timeout + 10
        if self.following and not self.done.wait(grace):
            log.warning("rank 0 did not leave within %.0fs of SIGTERM; exiting", grace)
        super().stop()
