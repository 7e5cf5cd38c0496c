"""The serving attention node: the engine on its own thread, the OpenAI API (uvicorn) in the main one.

SIGTERM (or SIGINT): /health turns 503 and new requests get 503; running requests get up to
`engine.shutdown_timeout` seconds to finish (0 aborts them at once); then the node leaves the data
plane and exits. The FFN nodes stop once every attention node has left.

An engine that stops for good (a peer lost for longer than `cluster.rejoin_timeout`, or an engine failure) has
failed its requests with a 503 naming why; the node then exits with ENGINE_STOPPED_EXIT, ENGINE_STOPPED_GRACE_S
later, so that its supervisor (afd launch, afd serve, Kubernetes) starts it again and it re-forms its pairs: a
live process never sits in front of a dead engine, answering 503 while `afd status` says READY.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import TYPE_CHECKING

from afd.control import control_pb2 as pb
from afd.node.signals import exit_with
from attention_node.api_server import ServerState
from attention_node.memory import fix_mmap_threshold
from attention_node.node import AttentionNode

if TYPE_CHECKING:
    from attention_node.http_server import UvicornServer

log = logging.getLogger("afd.attention")

ENGINE_STOPPED_EXIT = 3
"""The exit code of a serving node whose engine stopped for good (0: asked to stop, 1: failed to start, 2: a port in
use)."""
PAUSED_LEN = 300
"""Characters of a pause's reason that the heartbeat carries (gloo's errors run to a kilobyte)."""
ENGINE_STOPPED_GRACE_S = 2.0
"""Seconds between the engine's stop and the exit: the failed requests' 503s and their streams' error events are
written meanwhile, and requests that arrive get a 503 naming why."""


class ServingNode(AttentionNode):
    """Rank 0 of a serving attention node: the engine on its own thread, the API in this one."""

    def __init__(self, cfg, args):
        super().__init__(cfg, args)
        self.state: ServerState | None = None
        self.server: UvicornServer | None = None
        self.sock: socket.socket | None = None
        self.restarting = False

    def start(self) -> None:
        from attention_node.http_server import api_listen, api_socket, check_tls
        from attention_node.setup import serving_state

        node, http_host = self.cfg.node(self.args.node), self.args.host or self.args.bind_host
        what = f"attention node {node.name}'s ports.http"
        check_tls(self.cfg.http)
        port = node.ports.http
        assert port is not None  # the configuration's check: attention nodes need an http port
        self.sock = api_socket(http_host, port, what)
        super().start()
        self.state = serving_state(self)
        if self.runtime is not None:
            self.runtime.paused = self._paused
            self.state.engine.on_pause = self.runtime.client.poke
        api_listen(self.sock, what)

    def _on_status(self, status) -> None:  # Drain: no new requests, running ones finish
        st = self.state
        if status is not None and st is not None and self.args.node in status.draining and not st.draining:
            log.info("draining: new requests get 503, %d running finish", st.engine.num_unfinished())
            st.draining = True

    def serve(self) -> int:
        from attention_node.api_server import build_app
        from attention_node.http_server import api_server, serve_on

        cfg, args = self.cfg, self.args
        node = cfg.node(args.node)
        st, sock = self.state, self.sock
        assert st is not None and sock is not None  # set by start()
        fix_mmap_threshold()  # a huge body's memory goes back to the system once it is answered
        self.server = api_server(build_app(st), cfg.http, sock)
        st.engine.on_dead = self._engine_stopped
        st.engine.start()
        log.info(
            "API ready at %s://%s:%d (cluster %s, %s)",
            cfg.http.scheme,
            node.host,
            node.ports.http,
            cfg.cluster.name,
            cfg.topology_name,
        )
        serve_on(self.server, sock)
        return 0

    def _paused(self) -> str:
        """Why this node's requests wait, naming the peer, for its heartbeats (afd status says DEGRADED)."""
        st = self.state
        assert st is not None  # set by start() before it hands this to the heartbeats
        engine, names = st.engine, self.cfg.process_names
        why, peer = engine.paused, engine.paused_peer
        if not why:
            return ""
        if len(why) > PAUSED_LEN:
            why = f"{why[:PAUSED_LEN]}..."
        return f"waiting for {names[peer]}: {why}" if peer is not None and 0 <= peer < len(names) else why

    def _engine_stopped(self, reason: str) -> None:
        st = self.state
        if st is None or st.draining:  # stopping anyway: the exit code stays the stop's
            return
        log.error(
            "exiting with code %d in %.0f s, to be started again: %s",
            ENGINE_STOPPED_EXIT,
            ENGINE_STOPPED_GRACE_S,
            reason,
        )
        self.restarting = True  # the cluster goes on: the coordinator's node leaves without shutting it down
        timer = threading.Timer(ENGINE_STOPPED_GRACE_S, exit_with, (ENGINE_STOPPED_EXIT,))
        timer.daemon = True
        timer.start()

    def stop(self) -> None:
        """Drains (up to engine.shutdown_timeout), stops the engine (it leaves the data plane), and, on
        the coordinator's node, shuts the cluster down."""
        st, rt = self.state, self.runtime
        if st is not None:
            st.draining = True
            deadline = time.monotonic() + self.cfg.engine.shutdown_timeout
            while st.engine.num_unfinished() and time.monotonic() < deadline and not st.engine.dead:
                time.sleep(0.05)
            left = st.engine.num_unfinished()
            if left:
                log.info("aborting %d unfinished request(s) at shutdown", left)
            st.engine.stop(timeout=5)
        if rt is not None:
            coordinator = rt.node.name == self.cfg.coordinator.name
            if rt.cluster_state != pb.ClusterStatus.SHUTDOWN and coordinator and not self.restarting:
                rt.client.shutdown_cluster("coordinator node stopped")
            rt.close(plane=False)
