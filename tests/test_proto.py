"""The committed gRPC stubs match proto/ (regenerate with `make proto`)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _descriptor(pb2_file: Path) -> bytes:
    text = pb2_file.read_text()
    start = text.index("AddSerializedFile(") + len("AddSerializedFile(")
    return eval(text[start : text.index(")\n", start)])  # the serialized FileDescriptorProto literal


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="grpcio-tools not installed")
def test_committed_stubs_are_fresh(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'proto'}",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            str(ROOT / "proto/afd/control/control.proto"),
        ],
        check=True,
    )
    fresh = tmp_path / "afd/control"
    committed = ROOT / "afd/control"
    assert _descriptor(fresh / "control_pb2.py") == _descriptor(committed / "control_pb2.py"), (
        "afd/control/control_pb2.py is stale: run `make proto`"
    )
    methods = [line.strip() for line in (fresh / "control_pb2_grpc.py").read_text().splitlines() if "def " in line]
    assert methods == [
        line.strip() for line in (committed / "control_pb2_grpc.py").read_text().splitlines() if "def " in line
    ], "afd/control/control_pb2_grpc.py is stale: run `make proto`"
