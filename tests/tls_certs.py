"""Certificates the TLS tests make with the openssl binary (the `cryptography` package is not a dependency):
a CA, a server certificate for 127.0.0.1 and localhost, and a client certificate, all signed by the CA."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from cluster_helpers import skip_unless_ci_installs


@pytest.fixture(scope="module")
def openssl():
    if shutil.which("openssl") is None:
        skip_unless_ci_installs("openssl is not installed (apt-get install openssl)")


def make_certs(d: Path) -> dict:
    """{ca, cert, key, client_cert, client_key}: file paths under `d`."""

    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    key = ("-newkey", "rsa:2048", "-nodes")
    run("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=afd-test-ca")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, cn in (("node", "afd-node"), ("client", "afd-client")):
        run("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}")
        sign = ("-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1", "-extfile", "san.ext")
        run("x509", "-req", "-in", f"{name}.csr", "-out", f"{name}.pem", *sign)
    return {
        "ca": str(d / "ca.pem"),
        "cert": str(d / "node.pem"),
        "key": str(d / "node.key"),
        "client_cert": str(d / "client.pem"),
        "client_key": str(d / "client.key"),
    }
