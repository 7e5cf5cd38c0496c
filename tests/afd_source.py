"""afd's source as the vendor tests read it: each module's syntax tree, and the dotted chain an attribute spells
(tests/test_vendor_npu.py, test_vendor_cuda.py, test_vendor_torchair.py)."""

from __future__ import annotations

import ast
from functools import cache

from vendor_wheel import ROOT

AFD = ("afd", "attention_node", "ffn_node")


def dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


@cache
def afd_trees() -> dict[str, ast.Module]:
    return {
        str(p.relative_to(ROOT)): ast.parse(p.read_text())
        for package in AFD
        for p in sorted((ROOT / package).rglob("*.py"))
    }
