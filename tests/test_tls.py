"""The control plane over mutual TLS (cluster.tls), with certificates made by openssl for the test."""

from __future__ import annotations

import shutil
import subprocess

import grpc
import pytest
from cluster_helpers import Cluster, cluster_yaml, post, skip_unless_ci_installs
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = pytest.mark.multiprocess


@pytest.fixture(autouse=True)
def _openssl():
    if shutil.which("openssl") is None:
        skip_unless_ci_installs("openssl is not installed (apt-get install openssl)")


def _certs(d) -> dict:
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=afd-test-ca",
    )
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=afd-node")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run(
        "x509",
        "-req",
        "-in",
        "node.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "node.pem",
        "-days",
        "1",
        "-extfile",
        "san.ext",
    )
    return {"cert": str(d / "node.pem"), "key": str(d / "node.key"), "ca": str(d / "ca.pem")}


def test_cluster_forms_and_serves_over_mutual_tls(tiny_checkpoint, tmp_path):
    path = cluster_yaml(tmp_path, tiny_checkpoint, name="tls", cluster={"tls": _certs(tmp_path)})
    with Cluster(path) as c:
        c.start_all()
        c.wait_ready()
        code, body = post(c.url(), "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0})
        assert code == 200 and body["usage"]["completion_tokens"] >= 1
        # the control port speaks only TLS: a plaintext health check gets nowhere
        port = c.node("attn0")["ports"]["control"]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch, pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
