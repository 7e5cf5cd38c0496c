"""The cluster token: from AFD_CLUSTER_TOKEN, or made by `afd launch` for the clusters it starts.

Kept here, apart from the gRPC auth that checks it (afd/control/auth.py), because `afd launch` hands it
to its nodes and the control plane imports the cluster package, not the other way round.
"""

from __future__ import annotations

import os

TOKEN_ENV = "AFD_CLUSTER_TOKEN"


def cluster_token() -> str | None:
    return os.environ.get(TOKEN_ENV) or None


def token_file(cluster_name: str, coordinator_port: int) -> str:
    """Where `afd launch` keeps the token it made for a cluster on this host (mode 0600), so that
    `afd status` from the same user finds it."""
    base = os.environ.get("XDG_RUNTIME_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "afd"
    )
    return os.path.join(base, "afd-tokens", f"{cluster_name}-{coordinator_port}")


def make_launch_token(cluster_name: str, coordinator_port: int) -> str:
    """A fresh token for a cluster `afd launch` starts on this host without AFD_CLUSTER_TOKEN."""
    import secrets

    token = secrets.token_hex(16)
    path = token_file(cluster_name, coordinator_port)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


def launched_token(cluster_name: str, coordinator_port: int) -> str | None:
    """AFD_CLUSTER_TOKEN, else the token `afd launch` made for this cluster here."""
    if cluster_token():
        return cluster_token()
    try:
        with open(token_file(cluster_name, coordinator_port)) as f:
            return f.read().strip() or None
    except OSError:
        return None
