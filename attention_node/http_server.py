"""The API's uvicorn server: its socket bound before the node loads anything (a port in use is one line, not
a traceback after minutes of loading), TLS from `http.ssl_*`, and http_conn's read deadlines."""

from __future__ import annotations

import contextlib
import socket
import ssl

import uvicorn

from afd.cluster.ports import listen, listen_socket
from afd.config.http_section import HttpSection
from attention_node.http_conn import protocol_class


class UvicornServer(uvicorn.Server):
    """uvicorn without its own signal handlers: this process takes signals on a sigwait thread."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def api_socket(host: str, port: int, what: str) -> socket.socket:
    """The API's socket, bound (PortInUse when taken) but not listening until `api_listen`: until then a client
    is refused at once rather than left waiting while the node loads."""
    return listen_socket(host, port, what)


def api_listen(sock: socket.socket, what: str) -> None:
    """Listens on the API's socket once the node is up (PortInUse if another process took it meanwhile)."""
    listen(sock, what)


def check_tls(http: HttpSection) -> None:
    """A certificate or key that cannot be loaded, as one line (ValueError) before anything starts."""
    if not http.tls:
        return
    assert http.ssl_certfile is not None  # http.tls: a certificate is given
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(http.ssl_certfile, http.ssl_keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"http.ssl_certfile {http.ssl_certfile} / ssl_keyfile {http.ssl_keyfile}: {e}") from None


def api_server(app, http: HttpSection, sock: socket.socket) -> UvicornServer:
    """uvicorn serving `app` on `sock` (run it with `serve_on(server, sock)`)."""
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol_class(http),
        timeout_keep_alive=http.keep_alive_timeout,  # type: ignore[arg-type]  # uvicorn's call_later takes a float
        ssl_certfile=http.ssl_certfile,
        ssl_keyfile=http.ssl_keyfile,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=1,
    )
    return UvicornServer(config)


def serve_on(server: UvicornServer, sock: socket.socket) -> None:
    server.run(sockets=[sock])
