"""torch's own surface, read from the wheel this repository installs: what torch_npu's and NCCL's process groups
inherit from c10d (tests/test_vendor_npu.py, tests/test_vendor_cuda.py)."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import torch

TORCH = Path(torch.__file__).parent


@cache
def c10d_stub() -> dict[str, set[str]]:
    """Class (dotted for nested) -> its member names, from torch/_C/_distributed_c10d.pyi."""
    out: dict[str, set[str]] = {}

    def walk(cls: ast.ClassDef, prefix: str) -> None:
        name = prefix + cls.name
        members = out.setdefault(name, set())
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                members.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                members.add(node.target.id)
            elif isinstance(node, ast.ClassDef):
                members.add(node.name)
                walk(node, name + ".")

    for node in ast.parse((TORCH / "_C" / "_distributed_c10d.pyi").read_text()).body:
        if isinstance(node, ast.ClassDef):
            walk(node, "")
    return out


@cache
def c10d_virtuals() -> set[str]:
    """The methods a c10d Backend or ProcessGroup declares virtual, and those a Python subclass may override
    (torch's include/torch/csrc/distributed/c10d headers, shipped in the wheel this repository installs)."""
    inc = TORCH / "include" / "torch" / "csrc" / "distributed" / "c10d"
    names: set[str] = set()
    for header in ("Backend.hpp", "ProcessGroup.hpp"):
        names |= set(re.findall(r"virtual\s[^;{(]*?\b(\w+)\s*\(", (inc / header).read_text()))
    py = (inc / "PyProcessGroup.hpp").read_text()
    names |= set(re.findall(r"(\w+),\s*/\*\s*Name", py)) | set(re.findall(r'get_override\(\s*[^"]*?"(\w+)"', py, re.S))
    return names
