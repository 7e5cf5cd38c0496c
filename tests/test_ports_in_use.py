"""A port a node would listen on that something else holds: one line naming the port, its host and what it is
for, exit code 2, no traceback, before the node loads anything. Every listener of `afd-attention` and `afd-ffn`
(API, control, metrics), the colocated server's, and `afd serve`'s."""

from __future__ import annotations

import socket
import subprocess
import sys

import forked_python
import pytest
from cluster_helpers import ROOT, cluster_yaml

pytestmark = pytest.mark.multiprocess


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return forked_python.run([sys.executable, *argv], timeout=120, cwd=ROOT)


def _taken(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def _one_line(r: subprocess.CompletedProcess, expected: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize(
    "node,key",
    [("attn0", "http"), ("attn0", "control"), ("ffn0", "control"), ("ffn0", "metrics")],
)
def test_a_node_names_its_port_in_use(tiny_checkpoint, tmp_path, node, key):
    path = cluster_yaml(tmp_path, tiny_checkpoint)
    import yaml

    doc = yaml.safe_load(path.read_text())
    port = next(n for n in doc["nodes"] if n["name"] == node)["ports"][key]
    module = "attention_node.main" if node.startswith("attn") else "ffn_node.main"
    role = "attention" if node.startswith("attn") else "FFN"
    with _taken(port):
        r = _run(["-m", module, "--config", str(path), "--node", node])
    _one_line(r, f"port {port} on 127.0.0.1 is in use ({role} node {node}'s ports.{key}")


def test_the_colocated_server_names_its_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _run(["-m", "afd", "serve", "demo", "--colocated", "--port", str(port)])
    _one_line(r, f"port {port} on 127.0.0.1 is in use (the colocated server's --port)")


def test_afd_serve_names_its_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _run(["-m", "afd", "serve", "demo", "--port", str(port)])
    _one_line(r, f"{port} (attn0.ports.http)")


def test_a_port_taken_between_bind_and_listen_is_named():
    """The API binds its port before the node loads, and listens once it is up: another process that bound
    it meanwhile (SO_REUSEADDR lets both bind) and listened first is caught at listen."""
    from afd.cluster.ports import PortInUse, listen, listen_socket

    ours = listen_socket("127.0.0.1", 0, "ours")
    port = ours.getsockname()[1]
    theirs = listen_socket("127.0.0.1", port, "theirs")
    try:
        theirs.listen()
        with pytest.raises(PortInUse, match=f"port {port} on 127.0.0.1 is in use \\(attention node a's ports.http\\)"):
            listen(ours, "attention node a's ports.http")
    finally:
        ours.close()
        theirs.close()
