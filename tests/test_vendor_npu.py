"""afd's Ascend code and the fake torch_npu are held to the torch_npu 2.14.0 wheel and to torch's own files, not to
each other: a fake written from the same reading as the code repeats its mistakes (`dist.ProcessGroupHCCL`
and a pair group's `_get_backend` passed every fake test and exist in neither).

What counts as real is in tests/vendor_wheel.py: an op's prototype in the wheel's `_op_plugin_docs.py`, a name its
Python defines or uses, a name its library binds; torch's `.pyi` stubs and C++ headers for what torch_npu's
classes inherit from c10d.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys

import pytest
import torch.distributed as dist
from afd_source import afd_trees, dotted
from vendor_torch import c10d_stub, c10d_virtuals
from vendor_wheel import ROOT, npu_wheel

FAKES = ROOT / "tests" / "fakes"


@pytest.fixture(scope="module")
def wheel():
    return npu_wheel()


# ---- afd's calls -------------------------------------------------------------------------------------------------


def afd_npu_names() -> dict[str, str]:
    """Every torch_npu name afd reaches -> where: `torch_npu.X.Y` chains and imports, `torch.npu.X` (torch_npu's
    torch_npu.npu), torch_npu's ops however they are reached (`self._torch_npu.npu_x`, `getattr(m, "npu_x")`),
    and what afd takes from torch.distributed in its Ascend backend."""
    out: dict[str, str] = {}
    for rel, tree in afd_trees().items():
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # the longest chain counts
        for node in ast.walk(tree):
            where = f"{rel}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and id(node) not in inner:
                chain = dotted(node)
                if chain and (chain.startswith("torch_npu.") or chain.startswith("torch.npu.")):
                    out.setdefault(chain.replace("torch.npu.", "torch_npu.npu.", 1), where)
                if node.attr.startswith("npu_"):
                    out.setdefault(f"torch_npu.{node.attr}", where)
                if chain and chain.startswith("dist.") and rel.startswith("afd/backend/npu"):
                    out.setdefault("torch.distributed." + chain.split(".", 1)[1], where)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch_npu"):
                for alias in node.names:
                    out.setdefault(f"{node.module}.{alias.name}", where)
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", "") == "getattr"
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and str(node.args[1].value).startswith("npu_")
            ):
                out.setdefault(f"torch_npu.{node.args[1].value}", where)
    return out


def real(wheel, name: str) -> str | None:
    """Why `name` is real (a line for the failure message), or None."""
    if name.startswith("torch.distributed."):
        attr = name.split(".")[2]
        return "torch.distributed" if hasattr(dist, attr) else None
    parts = name.split(".")
    if len(parts) == 2 and wheel.signature(parts[1]) is not None:
        return "a registered or documented op"
    if wheel.used(name) or _imported_by_wheel(wheel, name):
        return "the wheel's own code uses it"
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        if wheel.module(module):
            rest = parts[cut:]
            return f"defined in {module}" if len(rest) == 1 and wheel.defines(module, rest[0]) else None
    return None


def _imported_by_wheel(wheel, name: str) -> bool:
    module, _, leaf = name.rpartition(".")
    pattern = re.compile(rf"from {re.escape(module)} import [^\n]*\b{re.escape(leaf)}\b")
    return any(pattern.search(src) for src in wheel.python.values())


def test_every_torch_npu_name_afd_calls_is_in_the_wheel(wheel):
    used = afd_npu_names()
    assert "torch_npu.npu_grouped_matmul" in used and "torch_npu.npu.synchronize" in used  # the scan sees them
    missing = {name: where for name, where in sorted(used.items()) if real(wheel, name) is None}
    assert not missing, "afd calls names torch_npu 2.14.0 does not have:\n" + "\n".join(
        f"  {name} ({where})" for name, where in missing.items()
    )


def test_the_scan_names_what_issue_45_found():
    """Today's scan on the code before the fixes: `dist.ProcessGroupHCCL` is no name of torch.distributed, and a
    pair group's abort through `_get_backend` reaches a method only ProcessGroup has (test below)."""
    assert not hasattr(dist, "ProcessGroupHCCL")
    wheel = npu_wheel()
    assert real(wheel, "torch.distributed.ProcessGroupHCCL") is None
    assert real(wheel, "torch_npu._C._distributed_c10d.ProcessGroupHCCL") is not None
    assert real(wheel, "torch_npu.npu_not_an_op") is None and real(wheel, "torch_npu.npu.not_a_function") is None


def _op_calls() -> list[tuple[str, ast.Call, str]]:
    calls = []
    for rel, tree in afd_trees().items():
        for node in ast.walk(tree):
            func = getattr(node, "func", None)
            if isinstance(node, ast.Call) and isinstance(func, ast.Attribute) and func.attr.startswith("npu_"):
                calls.append((node.func.attr, node, f"{rel}:{node.lineno}"))
    return calls


def _binding_errors(op: str, params, positional: int, keywords: list[str], starred: bool) -> list[str]:
    errors = []
    names = [p.name for p in params]
    takes_positional = [p for p in params if not p.keyword_only]
    if positional > len(takes_positional):
        errors.append(f"{positional} positional arguments, the op takes {len(takes_positional)}")
    errors += [f"keyword {k!r} is not the op's ({', '.join(names)})" for k in keywords if k not in names]
    given = {p.name for p in takes_positional[:positional]} | set(keywords)
    if not starred:
        errors += [f"required {p.name!r} not given" for p in params if p.required and p.name not in given]
    return errors


def test_every_op_call_binds_to_its_registered_schema(wheel):
    calls = _op_calls()
    assert {op for op, _, _ in calls} >= {"npu_grouped_matmul", "npu_prefetch", "npu_format_cast"}
    errors = []
    for op, call, where in calls:
        params = wheel.signature(op)
        if params is None:
            errors.append(f"{where}: torch_npu.{op} has neither a registered schema nor a documented prototype")
            continue
        starred = any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords)
        positional = sum(not isinstance(a, ast.Starred) for a in call.args)
        keywords = [k.arg for k in call.keywords if k.arg is not None]
        errors += [f"{where}: torch_npu.{op}: {e}" for e in _binding_errors(op, params, positional, keywords, starred)]
    assert not errors, "\n".join(errors)


def test_a_call_off_its_prototype_is_caught(wheel):
    params = wheel.signature("npu_prefetch")
    assert _binding_errors("npu_prefetch", params, 3, ["offset"], False) == []
    assert _binding_errors("npu_prefetch", params, 2, [], False) == ["required 'max_size' not given"]
    assert _binding_errors("npu_prefetch", params, 3, ["max_bytes"], False)[0].startswith("keyword 'max_bytes'")


# ---- the fakes ---------------------------------------------------------------------------------------------------

_DUMP = r"""
import inspect, json, sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import torch_npu
try:
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL
except ImportError:
    ProcessGroupHCCL = dist.ProcessGroupHCCL  # where the fake used to put it

from torch_npu.hccl_work import _Work as work_class  # what the fake pair group's send and recv return

def params(fn):
    sig = inspect.signature(fn)
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values()):
        schema = getattr(getattr(torch.ops.fake_npu, fn.__name__, None), "default", None)
        if schema is None:
            return None
        return [[a.name, a.kwarg_only, not a.has_default_value()] for a in schema._schema.arguments]
    return [[p.name, p.kind == p.KEYWORD_ONLY, p.default is p.empty] for p in sig.parameters.values()]

def own(cls, stop):
    names = set()
    for k in cls.__mro__:
        if k in stop or k.__module__.startswith("torch"):
            continue
        names |= {n for n in vars(k) if not n.startswith("__")}
    return sorted(names)

import __future__
modules = {type(sys), __future__._Feature}
out = {
    "top": {n: (params(v) if callable(v) and not isinstance(v, type) else None)
            for n, v in vars(torch_npu).items() if not n.startswith("_") and type(v) not in modules},
    "npu": sorted(n for n, v in vars(torch.npu).items() if not n.startswith("_") and type(v) not in modules),
    "pair_bases": [k.__module__ + "." + k.__qualname__ for k in ProcessGroupHCCL.__mro__],
    "pair_is_backend": issubclass(ProcessGroupHCCL, torch._C._distributed_c10d.Backend),
    "pair_is_process_group": issubclass(ProcessGroupHCCL, dist.ProcessGroup),
    "pair_own": own(ProcessGroupHCCL, ()),
    "options_slots": list(getattr(getattr(ProcessGroupHCCL, "Options", None), "__slots__", ())),
    "fake_only": sorted(getattr(torch_npu, "FAKE_ONLY", ())),
    "npu_fake_only": sorted(getattr(torch.npu, "FAKE_ONLY", ())),
    "methods": {
        name: {n: [[p.name, p.kind == p.KEYWORD_ONLY, p.default is p.empty]
                   for p in list(inspect.signature(f).parameters.values())[1:]]
               for n, f in vars(cls).items() if callable(f) and not n.startswith("_")}
        for name, cls in (("Stream", torch.npu.Stream), ("Event", torch.npu.Event), ("Work", work_class))
    },
}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fake():
    """The fake's surface as an importer sees it, read in a process of its own: importing it registers the npu
    device, which this test process must not have."""
    out = subprocess.run(
        [sys.executable, "-c", _DUMP, str(FAKES)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_fake_defines_no_torch_npu_name_the_wheel_lacks(wheel, fake):
    """Every public name of the fake torch_npu and of its torch.npu is the wheel's, or is declared fake-only
    (FAKE_ONLY: the fake's counters and checks), which the wheel must not have and afd must not call."""
    top = [n for n in fake["top"] if n not in fake["fake_only"]]
    missing = [f"torch_npu.{n}" for n in top if not real(wheel, f"torch_npu.{n}")]
    npu = [n for n in fake["npu"] if n not in fake["npu_fake_only"]]
    missing += [f"torch.npu.{n}" for n in npu if not wheel.defines("torch_npu.npu", n)]
    assert not missing, "the fake defines what torch_npu 2.14.0 does not: " + ", ".join(missing)
    clash = [n for n in fake["fake_only"] if real(wheel, f"torch_npu.{n}")]
    clash += [n for n in fake["npu_fake_only"] if wheel.defines("torch_npu.npu", n)]
    assert not clash, f"FAKE_ONLY names that torch_npu has: {clash}"
    reached = {n.split(".")[-1] for n in afd_npu_names()}
    assert not (set(fake["fake_only"]) | set(fake["npu_fake_only"])) & reached


def test_each_fake_op_takes_the_registered_schemas_arguments(wheel, fake):
    """A fake op binds a call as the real binding does: the op's positional arguments in order, only keywords the
    schema has, every required one (a fake may leave out optional arguments afd never passes)."""
    errors = []
    for name, params in sorted(fake["top"].items()):
        real_args = wheel.signature(name)
        if real_args is None or params is None:
            if name.startswith("npu_") and name not in fake["fake_only"]:
                errors.append(f"{name}: {'not an op of the wheel' if real_args is None else 'no signature to compare'}")
            continue
        positional = [p.name for p in real_args if not p.keyword_only]
        keywords = {p.name for p in real_args if p.keyword_only}
        got_positional = [n for n, kw, _ in params if not kw]
        got_keywords = {n for n, kw, _ in params if kw}
        if got_positional != positional[: len(got_positional)]:
            errors.append(f"{name}: positional {got_positional}, the op's {positional}")
        if got_keywords - keywords:
            errors.append(f"{name}: keywords the op lacks {sorted(got_keywords - keywords)}")
        lacking = [p.name for p in real_args if p.required and p.name not in got_keywords | set(got_positional)]
        if lacking:
            errors.append(f"{name}: required arguments the fake lacks {lacking}")
    assert not errors, "\n".join(errors)


def test_the_fake_pair_group_is_a_c10d_backend_as_torch_npus_is(wheel, fake):
    """torch_npu registers ProcessGroupHCCL through torch.distributed.Backend.register_backend: its creator returns a
    c10d Backend (the wheel's _init/registry/distributed.py). A Backend has no `_get_backend` (ProcessGroup's)."""
    registry = wheel.python["torch_npu/_init/registry/distributed.py"]
    assert "Backend.register_backend" in registry
    assert "return torch_npu._C._distributed_c10d.ProcessGroupHCCL(" in registry
    assert fake["pair_is_backend"] and not fake["pair_is_process_group"], (
        f"the fake pair group derives from {fake['pair_bases']}: a ProcessGroup answers `_get_backend`, which "
        "torch_npu's ProcessGroupHCCL, a c10d Backend, does not have"
    )
    surface = c10d_virtuals() | c10d_stub()["Backend"]
    torch_api = c10d_stub()["ProcessGroup"] | c10d_stub()["Backend"]  # a private name counts where it is torch's
    extra = [
        n
        for n in fake["pair_own"]
        if (not n.startswith("_") or n in torch_api) and n not in surface and not wheel.bound(n)
    ]
    assert not extra, f"the fake ProcessGroupHCCL has what neither c10d's Backend nor torch_npu binds: {extra}"
    options = c10d_stub()["Backend.Options"]
    extra = [n for n in fake["options_slots"] if n not in options and not wheel.bound(n)]
    assert not extra, f"the fake ProcessGroupHCCL.Options has what torch_npu's lacks: {extra}"


def _wheel_methods(wheel, path: str, cls: str) -> dict[str, list[str]]:
    """A class of the wheel's Python: its methods' parameters, self left out."""
    for node in ast.parse(wheel.python[path]).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {
                f.name: [a.arg for a in f.args.args[1:] + f.args.kwonlyargs]
                for f in node.body
                if isinstance(f, ast.FunctionDef)
            }
    raise AssertionError(f"{path} defines no class {cls}")


def test_the_objects_the_fake_returns_have_only_the_real_ones_methods(wheel, fake):
    """What afd calls on what torch.npu and the pair group hand back (a stream, an event, a send's work) is held to
    the real classes: torch_npu.npu.streams' Stream and Event (methods and their parameters), and c10d's Work (torch's
    stub). The fake's own machinery is private (_merge, _stuck), so a public method afd reaches is a real one."""
    errors = []
    for cls in ("Stream", "Event"):
        real_methods = _wheel_methods(wheel, "torch_npu/npu/streams.py", cls)
        for name, got in fake["methods"][cls].items():
            if name not in real_methods:
                errors.append(f"torch.npu.{cls}.{name}: not a method of torch_npu's {cls}")
                continue
            names = [n for n, _, _ in got]
            if names != real_methods[name][: len(names)]:
                errors.append(f"torch.npu.{cls}.{name}{tuple(names)}: torch_npu's takes {tuple(real_methods[name])}")
    work = c10d_stub()["Work"]
    errors += [f"the pair group's Work.{n}: not c10d's" for n in fake["methods"]["Work"] if n not in work]
    assert not errors, "\n".join(errors)
    assert {"wait_event", "synchronize"} <= set(fake["methods"]["Stream"]) and "record" in fake["methods"]["Event"]
