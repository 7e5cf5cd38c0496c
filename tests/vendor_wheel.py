"""The torch_npu wheel as the tests read it: never imported (it needs CANN), only opened as the zip it is.

`make setup` downloads it into .cache/vendor/, pinned by requirements-vendor.txt's hash. What it offers as
evidence that a name is real, strongest first:
- `schemas`: each op's schema as the library registers it with torch's dispatcher (`npu_x(Tensor input, *, ...)
  -> Tensor` strings in libtorch_npu.so, parsed by torch's own schema parser): the binding `torch_npu.npu_x`
  takes exactly these arguments;
- `prototypes`: each op's documented signature, from torch_npu/_op_plugin_docs.py (the text `help()` shows),
  for an op whose schema the library does not hold as text;
- `python`: the wheel's Python files, where a module, a function or a class is defined, and where torch_npu's
  own code uses a name (`torch_npu.get_npu_format(...)`);
- `bound`: the names libtorch_npu.so binds for Python (pybind11's method, class and attribute names are
  NUL-terminated strings in the library).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import re
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements-vendor.txt"
CACHE = ROOT / ".cache" / "vendor"


def locked(package: str = "torch_npu") -> tuple[str, str]:
    """(version, sha256) of `package` in requirements-vendor.txt."""
    text = LOCK.read_text().replace("\\\n", " ")
    m = re.search(rf"^{package}==(\S+)\s+--hash=sha256:([0-9a-f]{{64}})", text, re.M)
    assert m, f"{LOCK.name} pins no {package}"
    return m.group(1), m.group(2)


def wheel_path(package: str = "torch_npu") -> Path:
    version, digest = locked(package)
    found = sorted(CACHE.glob(f"{package}-{version}-*.whl"))
    assert found, f"no {package} {version} wheel in {CACHE}: `make setup` downloads it ({LOCK.name})"
    assert hashlib.sha256(found[0].read_bytes()).hexdigest() == digest, f"{found[0]} is not the wheel {LOCK.name} pins"
    return found[0]


@dataclass(frozen=True)
class Param:
    name: str
    keyword_only: bool
    required: bool


@dataclass
class Wheel:
    python: dict[str, str]
    """Path inside the wheel -> source, for every .py file."""
    prototypes: dict[str, list[Param]]
    """Op name -> its documented parameters, in order."""
    schemas: dict[str, list[Param]]
    """Op name -> its registered schema's arguments (the overload without a name), in order."""
    library: bytes = field(repr=False)

    def signature(self, op: str) -> list[Param] | None:
        """What `torch_npu.<op>` takes: its registered schema, else its documented prototype."""
        return self.schemas.get(op, self.prototypes.get(op))

    def bound(self, name: str) -> bool:
        """Whether the library holds `name` as a string of its own (a pybind11 binding's name)."""
        return b"\0" + name.encode() + b"\0" in self.library

    def defines(self, module: str, name: str) -> bool:
        """Whether the wheel's Python module `module` (dotted, e.g. torch_npu.npu) defines or imports `name` at
        its top level, or lists it in its __all__."""
        src = self.python.get(module.replace(".", "/") + ".py") or self.python.get(
            module.replace(".", "/") + "/__init__.py"
        )
        return src is not None and name in top_level_names(src)

    def module(self, dotted: str) -> bool:
        path = dotted.replace(".", "/")
        return f"{path}.py" in self.python or f"{path}/__init__.py" in self.python

    def used(self, chain: str) -> bool:
        """Whether the wheel's own Python code reaches `chain` (e.g. torch_npu.get_npu_format)."""
        pattern = re.compile(re.escape(chain) + r"\b")
        return any(pattern.search(src) for src in self.python.values())


def _parse(src: str) -> ast.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)  # the wheel's own invalid escapes, not ours
        warnings.simplefilter("ignore", DeprecationWarning)
        return ast.parse(src)


def top_level_names(src: str) -> set[str]:
    names: set[str] = set()
    for node in _parse(src).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names.add(target.id)
                    if target.id == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
                        names |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def parse_prototype(op: str, doc: str) -> list[Param] | None:
    """The parameters of `torch_npu.op(...) -> ...` in an op's docstring: `name`, `Type name`, `Type? name=None`,
    `*` for keyword-only; None when the docstring holds no prototype."""
    m = re.search(rf"(?:^|\s)(?:torch_npu\.)?{re.escape(op)}\((.*?)\)\s*->", doc, re.S)
    if m is None:
        return None
    params, keyword_only, depth, part = [], False, 0, ""
    parts = []
    for ch in m.group(1):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(part)
            part = ""
        else:
            part += ch
    parts.append(part)
    for raw in (p.strip() for p in parts):
        if not raw:
            continue
        if raw == "*":
            keyword_only = True
            continue
        left, _, default = raw.partition("=")
        name = left.split()[-1].strip()
        params.append(Param(name, keyword_only, required=not default))
    return params


@functools.cache
def npu_wheel() -> Wheel:
    with zipfile.ZipFile(wheel_path()) as z:
        python = {n: z.read(n).decode("utf-8", "replace") for n in z.namelist() if n.endswith(".py")}
        library = z.read("torch_npu/lib/libtorch_npu.so") + z.read(
            next(n for n in z.namelist() if n.startswith("torch_npu/_C.") and n.endswith(".so"))
        )
    docs: dict[str, str] = {}
    for node in ast.walk(_parse(python["torch_npu/_op_plugin_docs.py"])):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "_add_torch_npu_docstr":
            docs[node.args[0].value] = node.args[1].value
    prototypes = {op: p for op, doc in docs.items() if (p := parse_prototype(op, doc)) is not None}
    return Wheel(python, prototypes, registered_schemas(library), library)


def registered_schemas(library: bytes) -> dict[str, list[Param]]:
    import torch

    out: dict[str, list[Param]] = {}
    for text in re.findall(rb"\x00((?:npu_|get_npu_|_npu_)[\w.]*\([^\x00]{0,6000}?\) -> [^\x00]{1,600})\x00", library):
        try:
            schema = torch._C.parse_schema(text.decode())
        except RuntimeError:
            continue  # a C++ signature or a message that looks like one
        if not schema.overload_name:
            args = [Param(a.name, a.kwarg_only, not a.has_default_value()) for a in schema.arguments]
            out[schema.name.split("::")[-1]] = args
    return out
