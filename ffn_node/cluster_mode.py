"""An FFN node of a cluster YAML, run as its process: the node object is ffn_node/node.py's FFNNode."""

from __future__ import annotations

import logging

from afd.node.args import start_cluster_node

log = logging.getLogger("afd.ffn")


def run_cluster_node(args) -> int:
    cfg = start_cluster_node(args, "ffn")
    from afd.node.process import run_node
    from ffn_node.node import FFNNode

    return run_node(FFNNode(cfg, args), log)
