"""The fake torch_npu ops and fake torchair (tests/fakes) as the test_npu_fakes*.py files (and the other
tests of NpuBackend on the fakes) load them, with their shared fixtures and references.

The fakes load by path: tests/fakes is never put on sys.path, so find_spec("torch_npu") stays None for the
other tests (and tests/fakes/torch_npu/__init__.py, the fake device, is not needed here).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from afd.backend.npu import NpuBackend

FAKES = Path(__file__).resolve().parent / "fakes"


def _load_ops():
    spec = importlib.util.spec_from_file_location("afd_tests_fake_torch_npu_ops", FAKES / "torch_npu" / "ops.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # torch.compile looks traced functions' modules up by name
    spec.loader.exec_module(mod)
    return mod


ops = _load_ops()


@pytest.fixture(autouse=True)
def _fresh():
    ops.calls.clear()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _fake_torch_npu() -> types.ModuleType:
    m = types.ModuleType("torch_npu")
    for name in ("npu_grouped_matmul", "npu_prefetch", "npu_mm_reduce_scatter_base"):
        setattr(m, name, getattr(ops, name))
    return m


def _load_torchair():
    spec = importlib.util.spec_from_file_location(
        "torchair", FAKES / "torchair" / "__init__.py", submodule_search_locations=[str(FAKES / "torchair")]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["torchair"] = mod  # its submodules import relative to it
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules["torchair"]
        raise
    return mod


@pytest.fixture
def torchair(monkeypatch):
    """The fake torchair as `import torchair` sees it, with the fake torch_npu imported first."""
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu())
    before = {k: v for k, v in sys.modules.items() if k == "torchair" or k.startswith("torchair.")}
    yield _load_torchair()
    for k in [k for k in sys.modules if k == "torchair" or k.startswith("torchair.")]:
        del sys.modules[k]
    sys.modules.update(before)


def _npu_backend() -> NpuBackend:
    be = object.__new__(NpuBackend)  # no device here: skip __init__, keep the real methods
    be._torch_npu = _fake_torch_npu()
    return be


def _per_expert(x, w, sizes) -> torch.Tensor:
    """The reference: one float64 matmul per expert over its row slice."""
    out, start = [], 0
    for g, n in enumerate(sizes.tolist()):
        out.append(x[start : start + n].double() @ w[g].double())
        start += n
    return torch.cat(out)


def _close(y, ref, dtype):
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert y.dtype == dtype and y.shape == ref.shape
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)
