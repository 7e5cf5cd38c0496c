"""A real API server (uvicorn with afd's connection protocol and Guard) on a thread, over a small FastAPI app:
for the connection tests, which need real sockets but not a model."""

from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace

from fastapi import FastAPI, Request

from afd.config.http_section import HttpSection
from attention_node.http_guard import Guard
from attention_node.http_server import api_server, api_socket, serve_on


def echo_app(max_body_bytes: int, api_key: str | None = None):
    app = FastAPI()

    @app.post("/v1/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    @app.get("/health")
    async def health():
        return {}

    app.add_middleware(Guard, st=SimpleNamespace(api_key=api_key, max_body_bytes=max_body_bytes))
    return app


@contextlib.contextmanager
def running(http: HttpSection, app=None):
    """Serves `app` (default: echo_app with http.max_body_bytes) on a free port of 127.0.0.1; yields the port."""
    sock = api_socket("127.0.0.1", 0, "test server")
    server = api_server(app or echo_app(http.max_body_bytes), http, sock)
    thread = threading.Thread(target=serve_on, args=(server, sock), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test server did not start"
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
