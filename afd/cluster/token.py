"""The cluster token: from AFD_CLUSTER_TOKEN, or from the 0600 file AFD_CLUSTER_TOKEN_FILE names (the one
`afd launch` makes for the clusters it starts, or any other).

Kept here, apart from the gRPC auth that checks it (afd/control/auth.py), because `afd launch` hands it
to its nodes and the control plane imports the cluster package, not the other way round. A file rather
than a flag for the token itself: a command line is readable by every user of the host (`ps`), a 0600
file and a process's environment only by its own.
"""

from __future__ import annotations

import functools
import os
import stat
import sys

from afd.config.schema import ClusterConfigError

TOKEN_ENV = "AFD_CLUSTER_TOKEN"
TOKEN_FILE_ENV = "AFD_CLUSTER_TOKEN_FILE"


class TokenFileError(ClusterConfigError):
    """AFD_CLUSTER_TOKEN_FILE names a file that holds no usable token."""


def cluster_token() -> str | None:
    """AFD_CLUSTER_TOKEN, else the token in the file AFD_CLUSTER_TOKEN_FILE names, else None (no token)."""
    token = os.environ.get(TOKEN_ENV)
    if token:
        return token
    path = os.environ.get(TOKEN_FILE_ENV)
    return read_token_file(path) if path else None


@functools.cache
def read_token_file(path: str) -> str:
    """The token a file holds, read once per process: a node keeps the token it started with even after
    the launcher that wrote the file has removed it."""
    return read_secret(path, f"{TOKEN_FILE_ENV}={path}", TokenFileError)


def read_secret(path: str, what: str, error: type[Exception] = ValueError) -> str:
    """A secret kept in a file (a token, an API key), stripped; an unreadable or empty file is `error`,
    its message starting with `what` (how the user named the file)."""
    try:
        with open(path) as f:
            secret = f.read().strip()
    except OSError as e:
        raise error(f"{what}: cannot read it: {e.strerror or e}") from None
    if not secret:
        raise error(f"{what}: the file is empty")
    return secret


def token_file(cluster_name: str, coordinator_port: int) -> str:
    """Where `afd launch` keeps the token it made for a cluster on this host (mode 0600), so that
    `afd status` from the same user finds it."""
    base = os.environ.get("XDG_RUNTIME_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "afd"
    )
    return os.path.join(base, "afd-tokens", f"{cluster_name}-{coordinator_port}")


def launch_token_file(cluster_name: str, coordinator_port: int) -> tuple[str, bool]:
    """The token file of a cluster `afd launch` starts on this host without AFD_CLUSTER_TOKEN: (its path,
    whether it was made now). One already there (a launch's or `--print-commands`' own, still private to
    this user) is kept, so that nodes started by hand from printed commands and the launcher's agree."""
    path = token_file(cluster_name, coordinator_port)
    try:
        st = os.stat(path)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077 and read_token(path):
            return path, False
    except OSError:
        pass
    import secrets

    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"  # written whole, then renamed: a reader never sees half a token
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(16))
    os.replace(tmp, path)
    return path, True


def read_token(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def launched_token(cluster_name: str, coordinator_port: int) -> str | None:
    """The cluster token (cluster_token), else the token `afd launch` made for this cluster here."""
    return cluster_token() or read_token(token_file(cluster_name, coordinator_port))


def api_key(args) -> str | None:
    """--api-key-file's key, else --api-key (with a warning: the command line is visible in `ps`), else
    $AFD_API_KEY. A launcher hands the key to its nodes through the environment, never their command line.
    An unreadable or empty file is a ValueError naming it."""
    path, key = getattr(args, "api_key_file", None), getattr(args, "api_key", None)
    if path and key:
        raise ValueError("--api-key and --api-key-file: give one")
    if path:
        return read_secret(path, f"--api-key-file {path}")
    if key:
        print(
            "warning: --api-key on the command line is visible to every user of this host (`ps`); "
            "use --api-key-file FILE or $AFD_API_KEY",
            file=sys.stderr,
        )
        return key
    return os.environ.get("AFD_API_KEY")
