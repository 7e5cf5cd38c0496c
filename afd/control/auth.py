"""Cluster token auth and TLS for the control plane.

With AFD_CLUSTER_TOKEN set, every call carries it as `x-afd-cluster-token` metadata and the server
refuses calls without the same token (UNAUTHENTICATED, with a message that says which side is wrong).
"""

from __future__ import annotations

import hmac

import grpc

from afd.cluster.token import TOKEN_ENV, cluster_token

TOKEN_KEY = "x-afd-cluster-token"


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose token differs from the server's, except the standard health service."""

    def __init__(self, token: str):
        self._token = token.encode()

        def deny(request, context):
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"cluster token mismatch: the caller's {TOKEN_ENV} does not match this cluster's",
            )

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        # Health checks stay open: Kubernetes gRPC probes cannot send metadata, and health says nothing
        # a port scan would not.
        if handler_call_details.method.startswith("/grpc.health.v1.Health/"):
            return continuation(handler_call_details)
        sent = dict(handler_call_details.invocation_metadata).get(TOKEN_KEY, "")
        if hmac.compare_digest(sent.encode(), self._token):
            return continuation(handler_call_details)
        return self._deny


def call_metadata(token: str | None = None) -> tuple[tuple[str, str], ...]:
    token = token or cluster_token()
    return ((TOKEN_KEY, token),) if token else ()


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def server_credentials(tls: dict | None):
    if not tls:
        return None
    ca = _read(tls["ca"]) if tls.get("ca") else None
    return grpc.ssl_server_credentials(
        [(_read(tls["key"]), _read(tls["cert"]))], root_certificates=ca, require_client_auth=ca is not None
    )


RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
"""A node started before its coordinator retries registering every 0.3 s, but a gRPC channel that failed to
connect waits out its own reconnect backoff first (1 s, then growing to 120 s by default): a node would join
seconds after the coordinator came up, and a replacement after a re-form later still."""


def channel(address: str, tls: dict | None) -> grpc.Channel:
    if not tls:
        return grpc.insecure_channel(address, options=RECONNECT_OPTIONS)
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(tls["ca"]) if tls.get("ca") else None,
        private_key=_read(tls["key"]) if tls.get("key") else None,
        certificate_chain=_read(tls["cert"]) if tls.get("cert") else None,
    )
    return grpc.secure_channel(address, creds, options=RECONNECT_OPTIONS)
