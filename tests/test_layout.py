"""The house plan of docs/architecture.md, checked: one-way imports, no cycles between afd's folders,
a small top level, benchmarks imported only by the CLI, device SDKs only in afd/backend."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SDKS = ("torch_npu", "torchair")


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-local imports included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _files(package: str) -> list[Path]:
    return [p for p in (ROOT / package).rglob("*.py") if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))]


def _folder(path: Path) -> str | None:
    """afd's subsystem folder a file belongs to (None at the top level)."""
    rel = path.relative_to(ROOT / "afd").parts
    return rel[0] if len(rel) > 1 else None


def test_node_packages_never_import_each_other():
    for own, other in (("attention_node", "ffn_node"), ("ffn_node", "attention_node")):
        for f in _files(own):
            assert not any(m.split(".")[0] == other for m in _imports(f)), f"{f} imports {other}"
    for f in _files("afd"):
        assert not any(m.split(".")[0] in ("attention_node", "ffn_node") for m in _imports(f)), f


def test_afd_folders_form_no_cycle():
    folders = {p.name for p in (ROOT / "afd").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    edges: dict[str, set[str]] = {f: set() for f in folders}
    for f in _files("afd"):
        src = _folder(f)
        if src is None:
            continue
        for m in _imports(f):
            parts = m.split(".")
            if parts[0] == "afd" and len(parts) > 1 and parts[1] in folders and parts[1] != src:
                edges[src].add(parts[1])
    seen: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        if seen.get(n) == 1:
            raise AssertionError(f"import cycle between afd folders: {' -> '.join(path + [n])}")
        if seen.get(n) == 2:
            return
        seen[n] = 1
        for m in sorted(edges[n]):
            visit(m, path + [n])
        seen[n] = 2

    for n in sorted(folders):
        visit(n, [])
    assert "bench" not in set().union(*edges.values()), "only afd/cli.py may import afd.bench"


def test_top_level_of_afd_is_small():
    modules = [p.name for p in (ROOT / "afd").glob("*.py")]
    assert len(modules) <= 8, modules


def test_device_sdks_only_in_the_backend():
    for package in ("afd", "attention_node", "ffn_node"):
        for f in _files(package):
            if f.is_relative_to(ROOT / "afd" / "backend"):
                continue
            assert not any(m.split(".")[0] in SDKS for m in _imports(f)), f"{f} imports a device SDK"


# ---- one launcher: node processes are started only by afd/cluster/processes.py ------------------------

NODE_MODULES = ("attention_node.main", "ffn_node.main")
LAUNCHER = "afd/cluster/processes.py"


def _popen_calls(src: str) -> int:
    def popen(f) -> bool:
        return (isinstance(f, ast.Name) and f.id == "Popen") or (isinstance(f, ast.Attribute) and f.attr == "Popen")

    return sum(isinstance(n, ast.Call) and popen(n.func) for n in ast.walk(ast.parse(src)))


def _launch_violations(files: dict[str, str]) -> list[str]:
    """Inside the packages only the launcher starts processes; elsewhere, a file that starts processes
    names no node module (else it is a second node launcher). deploy/k8s/tp_node.py, a pod's rank
    supervisor (standard library only), runs the command it is given."""
    out = []
    for rel, src in files.items():
        if rel == LAUNCHER or not _popen_calls(src):
            continue
        if rel.split("/")[0] in ("afd", "attention_node", "ffn_node"):
            out.append(f"{rel}: starts a process outside {LAUNCHER}")
        elif any(name in src for name in NODE_MODULES):
            out.append(f"{rel}: starts node processes outside {LAUNCHER}")
    return out


def test_node_processes_are_started_by_one_launcher():
    files = {
        str(p.relative_to(ROOT)): p.read_text()
        for p in ROOT.rglob("*.py")
        if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
    }
    assert _popen_calls(files[LAUNCHER]) == 1
    assert _launch_violations(files) == []
    # the rule catches both kinds of second launcher
    node = "import subprocess, sys\nsubprocess.Popen([sys.executable, '-m', 'ffn_node.main'])\n"
    assert _launch_violations(
        {"tests/helper.py": node, "afd/bench/x.py": "from subprocess import Popen\nPopen(['ls'])"}
    ) == [
        f"tests/helper.py: starts node processes outside {LAUNCHER}",
        f"afd/bench/x.py: starts a process outside {LAUNCHER}",
    ]
