"""A node's listeners: which ports a process binds, and one line (exit code 2) when one is taken."""

from __future__ import annotations

import errno
import socket


class PortInUse(OSError):
    """A port a node listens on is taken (`port 8000 on 127.0.0.1 is in use (attention node attn0's
    ports.http)`): said in one line, exit code 2, never a traceback."""


def listen_socket(host: str, port: int, what: str) -> socket.socket:
    """A TCP socket bound to (host, port) as servers bind it (SO_REUSEADDR: a port in TIME_WAIT is free), not
    yet listening. `what` names the listener in the error: "attention node attn0's ports.http"."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port} ({what}): {e}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(f"port {port} on {host} is in use ({what})") from None
        raise OSError(f"cannot listen on {host}:{port} ({what}): {e.strerror or e}") from None
    return sock


def listen(sock: socket.socket, what: str, backlog: int = 2048) -> None:
    """Starts listening on a socket of listen_socket. Two sockets with SO_REUSEADDR can both be bound to a port
    until one listens: a process that took the port since our bind is caught here, as PortInUse."""
    try:
        sock.listen(backlog)
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        host, port = sock.getsockname()[:2]
        raise PortInUse(f"port {port} on {host} is in use ({what})") from None


def check_free(host: str, port: int, what: str) -> None:
    """Raises PortInUse when (host, port) is taken now (the server binds it moments later). Other bind errors
    are left to the server's own bind, which says them in its terms."""
    try:
        listen_socket(host, port, what).close()
    except PortInUse:
        raise
    except OSError:
        pass


def listeners(cfg, name: str, tp_rank: int, bind_host: str, http_host: str | None = None, api=True) -> list[tuple]:
    """(host, port, what) of every socket process `name` (TP rank `tp_rank`) of `cfg` listens on: its control
    port and API (unless `api` is False: the offline mode) or metrics port (TP rank 0). The data plane's
    rendezvous is a service of the control port, so `ports.data` has no listener."""
    node = cfg.node(name)
    who = f"{'attention' if node.role == 'attention' else 'FFN'} node {name}"
    out = []
    if tp_rank == 0:
        out.append((bind_host, node.ports.control, f"{who}'s ports.control"))
        if node.ports.http is not None and node.role == "attention" and api:
            out.append((http_host or bind_host, node.ports.http, f"{who}'s ports.http"))
        if node.ports.metrics is not None and node.role == "ffn":
            out.append((bind_host, node.ports.metrics, f"{who}'s ports.metrics"))
    return out


def check_listeners(cfg, name: str, tp_rank: int, bind_host: str, http_host: str | None = None, api=True) -> None:
    """Raises PortInUse for the first listener of the process that is taken."""
    for host, port, what in listeners(cfg, name, tp_rank, bind_host, http_host, api):
        check_free(host, port, what)
