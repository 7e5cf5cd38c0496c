"""The cluster YAML's `http` section: the attention nodes' API server (TLS, and how long a client may take),
declared apart from afd.config.schema's other sections to keep that file small."""

from __future__ import annotations

from dataclasses import dataclass

from afd.config.fieldspec import POSITIVE, opt, size_arg


@dataclass(frozen=True)
class HttpSection:
    """The OpenAI API of every attention node (and of the colocated server)."""

    ssl_certfile: str | None = opt(None, "--ssl-certfile")
    """TLS certificate chain (PEM) of the API; with ssl_keyfile, the API speaks HTTPS only (vLLM's flag)."""
    ssl_keyfile: str | None = opt(None, "--ssl-keyfile")
    """The private key (PEM) of ssl_certfile."""
    keep_alive_timeout: float = opt(5.0, "--timeout-keep-alive", rule=POSITIVE)
    """Seconds a connection may stay idle (opened and nothing sent yet, or nothing since its last response)
    before it is closed (vLLM's and uvicorn's 5)."""
    header_timeout: float = opt(20.0, "--timeout-header", rule=POSITIVE)
    """Seconds from a request's first byte to the end of its headers; then 408 and the connection closes."""
    body_timeout: float = opt(20.0, "--timeout-body", rule=POSITIVE)
    """Seconds a request body may go without progress: each body_min_rate bytes received push the deadline
    a second later, never beyond this many seconds from now; then 408 and the connection closes."""
    body_min_rate: int = opt(500, "--body-min-rate", rule=POSITIVE)
    """Bytes per second of request body that keep a slow upload going (see body_timeout)."""
    max_body_bytes: int = opt(32 << 20, "--max-body-bytes", parse=size_arg)
    """Larger request bodies get 413: before a byte is read when Content-Length says so, else as soon as the
    limit is passed."""
    max_grammar_bytes: int = opt(256 << 10, "--max-grammar-bytes", parse=size_arg)
    """A structured output's schema, regex, grammar or choice list larger than this (as JSON text) gets a 400
    before it is compiled: 100k choices (1 MB) compiled for 19 s. vLLM has no such bound."""

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"
