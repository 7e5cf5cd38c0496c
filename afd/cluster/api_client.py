"""afd's own requests to its API (the launcher's /health wait, `afd drain`'s gauges, `afd status`'s URLs): over
HTTPS when the cluster YAML gives `http.ssl_certfile`, trusting that certificate alone."""

from __future__ import annotations

import ssl
import urllib.request

from afd.config.http_section import HttpSection


def api_url(http: HttpSection, host: str, port: int) -> str:
    return f"{http.scheme}://{host}:{port}"


def client_context(http: HttpSection) -> ssl.SSLContext | None:
    """None for plain HTTP. For HTTPS: a context that trusts the API's own certificate and nothing else (the
    file is on this host, as it is for the node); the host name is not checked, since the pinned certificate
    says more than a name would, and the YAML's host (an address, a service name) need not be in it."""
    if not http.tls:
        return None
    ctx = ssl.create_default_context(cafile=http.ssl_certfile)
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # a CA-signed leaf is trusted as itself
    ctx.check_hostname = False
    return ctx


def open_api(url: str, http: HttpSection, timeout: float):
    """urllib.request.urlopen of one of afd's API URLs, with the context `http` asks for."""
    return urllib.request.urlopen(url, timeout=timeout, context=client_context(http))
