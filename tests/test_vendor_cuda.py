"""afd's CUDA code held to torch's own files: every `torch.cuda.X` it calls exists in the installed torch (its
Python module imports without a GPU), with the keywords afd passes, and what it takes of c10d's NCCL group (absent
from this CPU build) is in torch's `_distributed_c10d.pyi` stub, from the same wheel."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import torch
from afd_source import afd_trees, dotted
from vendor_torch import c10d_stub, c10d_virtuals


def _cuda_calls() -> dict[str, list[tuple[list[str], str]]]:
    """`torch.cuda.X` (and `dist.ProcessGroupNCCL...`) chain -> the keyword lists of its calls, with where."""
    out: dict[str, list[tuple[list[str], str]]] = {}
    for rel, tree in afd_trees().items():
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or id(node) in inner:
                continue
            chain = dotted(node)
            if chain and (chain.startswith("torch.cuda.") or chain.startswith("dist.ProcessGroupNCCL")):
                call = calls.get(id(node))
                keywords = [k.arg for k in call.keywords if k.arg] if call is not None else []
                out.setdefault(chain, []).append((keywords, f"{rel}:{node.lineno}"))
    return out


def test_every_torch_cuda_name_afd_calls_is_torchs_with_its_keywords():
    used = _cuda_calls()
    assert {"torch.cuda.synchronize", "torch.cuda.Event", "dist.ProcessGroupNCCL.Options"} <= set(used)
    errors = []
    for chain, uses in sorted(used.items()):
        if chain.startswith("dist."):
            continue
        obj = torch
        try:
            for part in chain.split(".")[1:]:
                obj = getattr(obj, part)
        except AttributeError:
            errors.append(f"{chain} ({uses[0][1]}): not in torch {torch.__version__}")
            continue
        try:
            params = inspect.signature(obj).parameters
        except (TypeError, ValueError):
            continue  # a builtin without a signature: nothing more to hold it to
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            continue
        for keywords, where in uses:
            errors += [f"{where}: {chain} takes no keyword {k!r}" for k in keywords if k not in params]
    assert not errors, "\n".join(errors)


def test_the_nccl_pair_group_is_built_from_what_torchs_stub_declares():
    stub = c10d_stub()
    used = {c for c in _cuda_calls() if c.startswith("dist.")}
    assert used == {"dist.ProcessGroupNCCL", "dist.ProcessGroupNCCL.Options"}
    assert "ProcessGroupNCCL" in stub and "Options" in stub["ProcessGroupNCCL"]
    # afd sets the timeout an Options inherits from Backend.Options, and builds (store, rank, size, options)
    assert "_timeout" in stub["Backend.Options"]
    tree = ast.parse((Path(torch.__file__).parent / "_C" / "_distributed_c10d.pyi").read_text())
    nccl = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ProcessGroupNCCL")
    assert [ast.unparse(b) for b in nccl.bases] == ["Backend"]
    options = next(n for n in nccl.body if isinstance(n, ast.ClassDef) and n.name == "Options")
    assert [ast.unparse(b) for b in options.bases] == ["Backend.Options"]
    init = next(n for n in nccl.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert [a.arg for a in init.args.args] == ["self", "store", "rank", "size", "options"]


def test_torchs_own_files_are_read():
    assert {"_timeout"} <= c10d_stub()["Backend.Options"]
    assert "_get_backend" in c10d_stub()["ProcessGroup"] and "_get_backend" not in c10d_stub()["Backend"]
    assert {"abort", "shutdown", "send", "recv", "allreduce", "getBackendName"} <= c10d_virtuals()
