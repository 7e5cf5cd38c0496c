"""An attention node of a cluster YAML: control plane bring-up, the engine, and the HTTP API.

SIGTERM (or SIGINT): /health turns 503 and new requests get 503; running requests get up to
`engine.shutdown_timeout` seconds to finish (0 aborts them at once); then the node leaves the data
plane and exits. The FFN nodes stop once every attention node has left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import uvicorn

from afd.control import control_pb2 as pb
from afd.control.client import ControlError
from afd.dataplane.transport import PeerError
from afd.node.args import start_cluster_node
from afd.node.signals import set_stop_handler

log = logging.getLogger("afd.attention")


def run_cluster_node(args) -> int:
    cfg = start_cluster_node(args, "attention")
    if isinstance(cfg, int):
        return cfg
    box: dict = {}
    set_stop_handler(lambda _: _graceful_stop(box, cfg))
    from attention_node.setup import build_server_state

    try:
        st, rt = build_server_state(cfg, args, box)
    except (ControlError, PeerError, OSError, ValueError) as e:  # ValueError: model config/checkpoint
        log.error("startup failed: %s", e)
        return 1
    from attention_node.api_server import build_app

    node = cfg.node(args.node)
    config = uvicorn.Config(
        build_app(st),
        host=args.host or args.bind_host,
        port=node.ports.http,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=1,
    )
    server = UvicornServer(config)
    box["server"] = server
    st.engine.start()
    log.info(
        "API ready at http://%s:%d (cluster %s, %s)", node.host, node.ports.http, cfg.cluster.name, cfg.topology_name
    )
    server.run()
    return 0


class UvicornServer(uvicorn.Server):
    """uvicorn without its own signal handlers: this process takes signals on a sigwait thread."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _graceful_stop(box: dict, cfg) -> None:
    st, rt = box.get("state"), box.get("runtime")
    if st is not None:
        st.draining = True
        deadline = time.monotonic() + cfg.engine.shutdown_timeout
        while st.engine.num_unfinished() and time.monotonic() < deadline and not st.engine.dead:
            time.sleep(0.05)
        left = st.engine.num_unfinished()
        if left:
            log.info("aborting %d unfinished request(s) at shutdown", left)
        st.engine.stop(timeout=5)
    if rt is not None:
        if rt.cluster_state != pb.ClusterStatus.SHUTDOWN and rt.node.name == cfg.coordinator.name:
            rt.client.shutdown_cluster("coordinator node stopped")
        rt.close(plane=False)
    logging.shutdown()
    os._exit(0)
