"""The HTTP guard every request passes first: API key, body-size limit, and a JSON 500 for anything the
routes raise."""

from __future__ import annotations

import logging

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from attention_node.openai_protocol import ApiError

log = logging.getLogger("afd.api")


KEYED_ROUTES = ("/tokenize", "/detokenize")
"""Routes outside /v1 that the API key guards as well: they spend the server's CPU and memory on a client's text or
ids as a completion does (vLLM keys /v1 only). /health, /metrics and the model list stay open to probes."""


def keyed(path: str) -> bool:
    return path.startswith("/v1") or path in KEYED_ROUTES


class Guard:
    """API key, body-size limit, and a JSON 500 for anything the routes raise (answered here, so that
    the client's keep-alive connection survives). Plain ASGI rather than @app.middleware: Starlette's
    BaseHTTPMiddleware hides the client's disconnect from the routes, and a non-streaming request must
    see it to stop generating."""

    def __init__(self, app, st):
        """st: the ServerState (its api_key and max_body_bytes)."""
        self.app, self.st = app, st

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        st, headers = self.st, {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if st.api_key and keyed(scope["path"]) and headers.get("authorization") != f"Bearer {st.api_key}":
            return await JSONResponse(ApiError(401, "Unauthorized").body(), status_code=401)(scope, receive, send)
        size = headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > st.max_body_bytes):
            err = ApiError(413, _too_large(st), "body")
            # connection: close, and the body is never read: the connection lingers to drop it (http_conn)
            response = JSONResponse(err.body(), status_code=413, headers={"connection": "close"})
            return await response(scope, receive, send)
        started, received = False, 0

        async def receive_limited():  # a chunked body has no Content-Length: count what arrives
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > st.max_body_bytes:
                    raise HTTPException(413, _too_large(st))  # FastAPI passes HTTPException through body parsing
            return message

        async def send_tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive_limited, send_tracked)
        except ClientDisconnect:  # gone mid-body (or cut by a read deadline, which answered it): nobody to tell
            return
        except Exception as e:
            log.exception("%s %s failed", scope.get("method"), scope["path"])
            if started:  # too late for an error response
                raise
            err = ApiError(500, f"Internal error: {type(e).__name__}: {e}")
            await JSONResponse(err.body(), status_code=500)(scope, receive, send)


def _too_large(st) -> str:
    return f"The request body is larger than {st.max_body_bytes} bytes."
