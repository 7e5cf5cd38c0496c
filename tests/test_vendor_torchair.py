"""torchair held to the torch_npu 2.14.0 wheel, which ships it (torch_npu/dynamo/torchair, imported as `torchair`):
afd's calls bind to its definitions, and the torchair fake defines nothing its torchair lacks."""

from __future__ import annotations

import ast

import pytest
from afd_source import afd_trees, dotted
from vendor_wheel import ROOT, npu_wheel

FAKES = ROOT / "tests" / "fakes"


@pytest.fixture(scope="module")
def wheel():
    return npu_wheel()


TORCHAIR = "torch_npu/dynamo/torchair"
TORCHAIR_API = {  # what afd and the fake use -> where the wheel defines it
    "CompilerConfig": "configs/compiler_config.py",
    "get_npu_backend": "npu_fx_compiler.py",
    "get_compiler": "npu_fx_compiler.py",
    "inference.cache_compile": "inference/__init__.py",
}


def _def_params(src: str, name: str) -> tuple[list[tuple[str, bool, bool]], bool] | None:
    """(params as (name, keyword_only, required), takes **kwargs) of top-level def `name` in `src`."""
    from vendor_wheel import _parse

    for node in _parse(src).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            a = node.args
            pos = a.posonlyargs + a.args
            required = len(pos) - len(a.defaults)
            params = [(p.arg, False, i < required) for i, p in enumerate(pos)]
            params += [(p.arg, True, d is None) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
            return params, a.kwarg is not None
    return None


def test_every_torchair_name_afd_calls_is_the_wheels_with_its_keywords(wheel):
    uses: dict[str, list[list[str]]] = {}
    for tree in afd_trees().values():
        calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(tree):
            chain = dotted(node) if isinstance(node, ast.Attribute) and id(node) not in inner else None
            if chain and chain.startswith("torchair."):
                call = calls.get(id(node))
                uses.setdefault(chain[len("torchair.") :], []).append([k.arg for k in call.keywords] if call else [])
    assert "inference.cache_compile" in uses  # the scan sees afd's calls
    assert set(uses) <= set(TORCHAIR_API), f"afd uses torchair's {sorted(uses)}: add them to TORCHAIR_API"
    for name, calls in uses.items():
        src = wheel.python[f"{TORCHAIR}/{TORCHAIR_API[name]}"]
        leaf = name.split(".")[-1]
        if leaf[0].isupper():
            assert f"class {leaf}" in src, name
            continue
        params, open_ended = _def_params(src, leaf)
        names = {p for p, _, _ in params}
        for keywords in calls:
            assert open_ended or set(keywords) <= names, (name, keywords, names)


def test_the_torchair_fake_takes_what_the_wheels_torchair_takes(wheel):
    fake = FAKES / "torchair"
    for name, where in TORCHAIR_API.items():
        leaf = name.split(".")[-1]
        fake_src = (fake / ("inference.py" if name.startswith("inference.") else "__init__.py")).read_text()
        if leaf[0].isupper():
            assert f"class {leaf}" in wheel.python[f"{TORCHAIR}/{where}"], name
            continue
        real, real_open = _def_params(wheel.python[f"{TORCHAIR}/{where}"], leaf)
        got, _ = _def_params(fake_src, leaf)
        positional = [p for p, kw, _ in real if not kw]
        assert [p for p, kw, _ in got if not kw] == positional[: len([1 for _, kw, _ in got if not kw])], name
        extra = {p for p, kw, _ in got if kw} - {p for p, _, _ in real}
        assert real_open or not extra, f"fake torchair.{name} takes {sorted(extra)}, which the wheel's does not"
        lacking = [p for p, _, req in real if req and p not in {g for g, _, _ in got}]
        assert not lacking, (name, lacking)
    tree = ast.parse((fake / "__init__.py").read_text())
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    defined |= {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) and n.level for a in n.names}
    public = {n for n in defined if not n.startswith("_")}
    real = "torch_npu.dynamo.torchair"
    missing = [n for n in public if not (wheel.defines(real, n) or wheel.module(f"{real}.{n}"))]
    assert not missing, f"the torchair fake defines what the wheel's torchair does not: {missing}"
