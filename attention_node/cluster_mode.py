"""An attention node of a cluster YAML, run as its process: the node object is serving_node.py's
ServingNode. The YAML and the node's checks come first, without torch (its import takes seconds), so that a
mistake is refused at once."""

from __future__ import annotations

import logging

from afd.node.args import start_cluster_node

log = logging.getLogger("afd.attention")


def run_cluster_node(args) -> int:
    cfg = start_cluster_node(args, "attention")
    from afd.node.process import run_node
    from attention_node.serving_node import ServingNode

    return run_node(ServingNode(cfg, args), log)
