"""`auto` as a device (afd.backend.resolve_device, and get_backend / check_device through it): npu when
torch_npu imports and sees an NPU, else cuda when torch sees a GPU, else cpu.

The NPU here is a stub: a module named torch_npu (in sys.modules, or on sys.path in a subprocess) and a
torch.npu whose is_available() says what the case needs. Enough to test the choice, not the backend.
"""

from __future__ import annotations

import importlib.machinery
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import afd.backend as backend

ROOT = Path(__file__).resolve().parent.parent


def stub_torch_npu(monkeypatch, npu: bool | None) -> None:
    """npu None: torch_npu is not installed; False/True: it imports, and torch.npu.is_available() is that."""
    if npu is None:
        monkeypatch.setitem(sys.modules, "torch_npu", None)  # `import torch_npu` raises ModuleNotFoundError
        monkeypatch.delattr(torch, "npu", raising=False)
        return
    mod = types.ModuleType("torch_npu")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)  # what find_spec finds in sys.modules
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: npu), raising=False)


@pytest.fixture
def device_here(monkeypatch):
    """device_here(npu=..., cuda=...): the accelerators this test pretends the machine has."""

    def make(npu: bool | None, cuda: bool) -> None:
        stub_torch_npu(monkeypatch, npu)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)

    return make


@pytest.mark.parametrize(
    "npu, cuda, expected",
    [
        (None, False, "cpu"),
        (None, True, "cuda"),
        (False, False, "cpu"),
        (False, True, "cuda"),
        (True, False, "npu"),
        (True, True, "npu"),
    ],
)
def test_auto_resolves_to_the_best_device_here(device_here, npu, cuda, expected):
    device_here(npu, cuda)
    assert backend.resolve_device("auto") == expected


@pytest.mark.parametrize("name", ["cpu", "cuda", "npu", "tpu"])
def test_other_names_are_not_resolved(device_here, name):
    device_here(True, True)
    assert backend.resolve_device(name) == name


def test_get_backend_auto_constructs_the_npu_backend(device_here, monkeypatch):
    import afd.backend.npu

    made = []

    class FakeNpuBackend:
        def __init__(self, index: int = 0):
            made.append(index)

    device_here(True, False)
    monkeypatch.setattr(afd.backend.npu, "NpuBackend", FakeNpuBackend)
    assert isinstance(backend.get_backend("auto", 3), FakeNpuBackend) and made == [3]


def test_get_backend_auto_without_accelerators_is_cpu(device_here):
    device_here(None, False)
    assert backend.get_backend("auto").name == "cpu"


@pytest.mark.parametrize("npu, cuda", [(True, False), (None, True), (None, False)])
def test_check_device_accepts_auto(device_here, npu, cuda):
    """auto resolves to a device that is here, so its check passes (the npu one finds the stub)."""
    device_here(npu, cuda)
    backend.check_device("auto")


@pytest.mark.parametrize(
    "body, why",
    [
        ("raise RuntimeError('libascendcl.so: cannot open shared object file')", "RuntimeError: libascendcl.so"),
        ("import afd_no_such_dependency_of_torch_npu", "ModuleNotFoundError"),
    ],
)
def test_a_broken_torch_npu_is_skipped_with_a_warning(monkeypatch, tmp_path, caplog, body, why):
    """Installed but not importable (CANN's environment not set, a dependency missing): auto goes on to
    cuda/cpu, and the log says why npu was passed over."""
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text(body + "\n")
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.delattr(torch, "npu", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="afd.backend"):
        assert backend.resolve_device("auto") == "cpu"
    assert "torch_npu is installed but does not import" in caplog.text and why in caplog.text


def test_torch_npu_is_imported_only_when_auto_is_resolved(tmp_path):
    """A torch_npu package on sys.path (a fresh process): importing afd does not import it; resolving
    auto does, picks npu, and check_device and the colocated server's --device accept it."""
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text(
        "import types\nimport torch\ntorch.npu = types.SimpleNamespace(is_available=lambda: True)\n"
    )
    code = (
        "import sys\n"
        "import afd, afd.backend, afd.config.loader, afd.entrypoints.llm, attention_node.colocated\n"
        "assert 'torch_npu' not in sys.modules, 'imported at module import'\n"
        "assert attention_node.colocated.build_parser().parse_args(['--model', 'demo', '--device', 'auto'])"
        ".device == 'auto'\n"
        "print(afd.backend.resolve_device('auto'), 'torch_npu' in sys.modules)\n"
        "afd.backend.check_device('auto')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["npu", "True"]
