"""A cluster over TLS with certificates the test makes (openssl): the control plane over mutual TLS
(cluster.tls) and the API over HTTPS (http.ssl_certfile / ssl_keyfile)."""

from __future__ import annotations

import http.client
import ssl

import grpc
import pytest
from cluster_helpers import Cluster, cluster_yaml, post
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tls_certs import make_certs, openssl  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("openssl")]


def test_cluster_forms_and_serves_over_tls(tiny_checkpoint, tmp_path):
    certs = make_certs(tmp_path)
    tls = {k: certs[k] for k in ("cert", "key", "ca")}
    api = {"ssl_certfile": certs["cert"], "ssl_keyfile": certs["key"]}
    path = cluster_yaml(tmp_path, tiny_checkpoint, name="tls", cluster={"tls": tls}, http=api)
    with Cluster(path) as c:
        c.start_all()
        c.wait_ready()
        assert c.url().startswith("https://")
        ca = ssl.create_default_context(cafile=certs["ca"])  # as any client of the API: the CA, the host name
        body = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
        code, out = post(c.url(), "/v1/completions", body, context=ca)
        assert code == 200 and out["usage"]["completion_tokens"] >= 1
        with pytest.raises((OSError, http.client.HTTPException)):  # plain HTTP on the API port: no answer
            post(c.url().replace("https://", "http://"), "/v1/completions", body, timeout=10)
        # the control port speaks only TLS: a plaintext health check gets nowhere
        port = c.node("attn0")["ports"]["control"]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch, pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
