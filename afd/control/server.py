"""Each node's gRPC server: the standard health service and the rendezvous store (afd.control.kvstore),
plus the coordinator on the coordinator node and, on an FFN node, the Pairs service."""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from afd.cluster.ports import PortInUse, check_free
from afd.control import control_pb2_grpc as pb_grpc
from afd.control.auth import TokenInterceptor, cluster_token, server_credentials
from afd.control.kvstore import KeyValues, RendezvousServicer


class ControlServer:
    """`set_serving(True)` flips the standard health status that probes and `grpc_health_probe` read."""

    def __init__(
        self,
        host: str,
        port: int,
        tls: dict | None = None,
        coordinator=None,
        workers: int = 16,
        what: str = "",
        pairs=None,
    ):
        """`what` names the port in the error when it is taken ("attention node attn0's ports.control")."""
        what = what or "the control port"
        check_free(host, port, what)  # grpc says only that it could not bind, after logging its own errors
        token = cluster_token()
        # so_reuseport off: a second node on the same port must fail, not share it silently
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers),
            interceptors=[TokenInterceptor(token)] if token else [],
            options=[("grpc.so_reuseport", 0)],
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.kv = KeyValues()
        pb_grpc.add_RendezvousServicer_to_server(RendezvousServicer(self.kv), self.server)
        if coordinator is not None:
            pb_grpc.add_CoordinatorServicer_to_server(coordinator, self.server)
        if pairs is not None:  # an FFN node's (ffn_node/pairs.py)
            pb_grpc.add_PairsServicer_to_server(pairs, self.server)
        creds = server_credentials(tls)
        addr = f"{host}:{port}"
        try:  # taken since the check: grpc raises RuntimeError (older versions return 0)
            bound = self.server.add_secure_port(addr, creds) if creds else self.server.add_insecure_port(addr)
        except RuntimeError:
            bound = 0
        if not bound:
            raise PortInUse(f"port {port} on {host} is in use ({what})")
        self.set_serving(False)
        self.server.start()

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set("", status)

    def stop(self, grace: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait(grace + 1)
