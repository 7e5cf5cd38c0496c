"""TLS with certificates the test makes (openssl): the API over HTTPS (`http.ssl_certfile/ssl_keyfile`, vLLM's
--ssl-certfile/--ssl-keyfile) on a real server, afd's own clients pinned to its certificate, and the control
plane over mutual TLS (`cluster.tls`) refusing a client without a certificate."""

from __future__ import annotations

import socket
import ssl
import urllib.error
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from http_servers import running
from tls_certs import make_certs, openssl  # noqa: F401 (a fixture)

from afd.cluster.api_client import api_url, open_api
from afd.config.http_section import HttpSection
from afd.control.server import ControlServer


@pytest.fixture(scope="module")
def certs(tmp_path_factory, openssl):  # noqa: F811 (the fixture)
    return make_certs(tmp_path_factory.mktemp("certs"))


def test_the_api_speaks_https_only(certs):
    http = HttpSection(ssl_certfile=certs["cert"], ssl_keyfile=certs["key"])
    with running(http) as port:
        trusted = ssl.create_default_context(cafile=certs["ca"])
        r = httpx.post(f"https://127.0.0.1:{port}/v1/echo", content=b"abc", verify=trusted, timeout=10)
        assert r.status_code == 200 and r.json() == {"bytes": 3}
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):  # the real TLS: no CA, no trust
            httpx.get(f"https://127.0.0.1:{port}/health", timeout=10)
        with pytest.raises(httpx.TransportError):  # plain HTTP gets no answer
            httpx.post(f"http://127.0.0.1:{port}/v1/echo", content=b"abc", timeout=10)
        # afd's own clients (the launcher's /health wait, `afd drain`) trust the API's certificate itself
        url = api_url(http, "127.0.0.1", port)
        assert url.startswith("https://")
        with open_api(url + "/health", http, timeout=10) as r:
            assert r.status == 200
        other = HttpSection(ssl_certfile=certs["client_cert"], ssl_keyfile=certs["client_key"])
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # pinned: not the CA
            open_api(url + "/health", other, timeout=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check(port: int, creds) -> int:
    with grpc.secure_channel(f"127.0.0.1:{port}", creds) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_control_plane_with_a_ca_refuses_clients_without_a_certificate(certs, monkeypatch):
    monkeypatch.delenv("AFD_CLUSTER_TOKEN", raising=False)
    port = _free_port()
    read = {k: Path(v).read_bytes() for k, v in certs.items()}
    server = ControlServer("127.0.0.1", port, {"cert": certs["cert"], "key": certs["key"], "ca": certs["ca"]})
    try:
        with_cert = grpc.ssl_channel_credentials(read["ca"], read["client_key"], read["client_cert"])
        assert _check(port, with_cert) == health_pb2.HealthCheckResponse.NOT_SERVING
        for creds in (grpc.ssl_channel_credentials(read["ca"]),):  # TLS, but no client certificate
            with pytest.raises(grpc.RpcError) as err:
                _check(port, creds)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        server.stop(0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [["--colocated"], []], ids=["colocated", "1A1F"])
def test_afd_serve_over_https(certs, tmp_path, mode):
    """`afd serve --ssl-certfile --ssl-keyfile`: a completion over HTTPS; on 1A1F the launcher's own /health
    wait (which prints the URLs) goes over HTTPS too."""
    import ssl

    from cluster_helpers import post
    from serve_helpers import Served, free_port_run

    port = free_port_run(1)
    url = f"https://127.0.0.1:{port}"
    ca = ssl.create_default_context(cafile=certs["ca"])
    argv = ["demo", "--port", str(port), "--ssl-certfile", certs["cert"], "--ssl-keyfile", certs["key"], *mode]
    served = Served(argv, tmp_path / "serve.log", [url], tls=ca)
    try:
        served.wait_ready()
        code, out = post(url, "/v1/completions", {"prompt": "Experts", "max_tokens": 3}, context=ca)
        assert code == 200 and out["usage"]["completion_tokens"] >= 1
        if not mode:
            served.processes.wait_until(lambda: url in served.log.read_text(), 30, "the launcher to print the URL")
        else:  # the benchmark client over HTTPS, trusting the CA as any client does (SSL_CERT_FILE)
            import os
            import subprocess
            import sys

            from cluster_helpers import ROOT

            argv = ["bench", "--base-url", url, "--num-prompts", "2", "--random-input-len", "8"]
            argv += ["--random-output-len", "2", "--disable-tqdm"]
            env = {**os.environ, "SSL_CERT_FILE": certs["ca"]}
            r = subprocess.run(
                [sys.executable, "-m", "afd", *argv],
                capture_output=True,
                text=True,
                cwd=ROOT,
                timeout=120,
                env=env,
            )
            assert r.returncode == 0 and "Successful requests:                     2" in r.stdout, r.stdout + r.stderr
    finally:
        assert served.stop() == 0, served.log.read_text()
