"""What every node process does with its role's object: take SIGTERM/SIGINT to its `stop`, `start` it
(bring-up through the control plane), then `serve` until it is done.

Both roles' objects (attention_node's AttentionNode, ffn_node's FFNNode) have the same four methods; a
failed start is one line and exit code 1, never a traceback.
"""

from __future__ import annotations

import logging
from typing import Protocol

from afd.cluster.ports import PortInUse
from afd.control.client import ControlError
from afd.dataplane.transport import PeerError
from afd.node.signals import set_stop_handler

STARTUP_ERRORS = (ControlError, PeerError, OSError, ValueError)
"""Refused or timed out (control plane), a failed data plane, a missing file, a bad model config or
checkpoint (ValueError). A port in use (PortInUse, an OSError) exits 2."""


class NodeProcess(Protocol):
    def start(self) -> None:
        """Registers, loads its part of the model, joins the data plane."""

    def serve(self) -> int:
        """Runs until the node is done; returns the exit code."""

    def stop(self) -> None:
        """From the signal thread: drain, leave, close (the process exits right after)."""


def run_node(node: NodeProcess, log: logging.Logger) -> int:
    set_stop_handler(lambda _: node.stop())
    try:
        node.start()
    except PortInUse as e:  # a usage error, as in start_cluster_node's check: exit code 2
        log.error("%s", e)
        return 2
    except STARTUP_ERRORS as e:
        log.error("startup failed: %s", e)
        return 1
    return node.serve()
