"""The fake torchair (tests/fakes/torchair) against its documents: it needs torch_npu imported first, its
CompilerConfig takes only documented values, and cache_compile keeps to its rules and its cache layout.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from fake_ops_helpers import _fresh, _load_torchair, torchair  # noqa: F401  (_fresh, torchair: fixtures)

# ---- the fake torchair ---------------------------------------------------------------------------------


def test_torchair_needs_torch_npu_imported_first(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    with pytest.raises(ImportError, match="import torch_npu before torchair"):
        _load_torchair()


def test_compiler_config_takes_documented_values_only(torchair):  # noqa: F811 (the fixture)
    config = torchair.CompilerConfig()
    config.mode = "reduce-overhead"
    config.experimental_config.frozen_parameter = True
    config.experimental_config.tiling_schedule_optimize = True
    config.debug.graph_dump.type = "pbtxt"
    assert config.mode == "reduce-overhead" and config.experimental_config.frozen_parameter is True
    for target, name, value in (
        (config, "mode", "fast"),
        (config.experimental_config, "frozen_parameter", "yes"),
        (config.experimental_config, "static_model_ops_lower_limit", -2),
        (config.debug.graph_dump, "type", "json"),
        (config, "no_such_option", 1),
        (config, "debug", None),
    ):
        with pytest.raises(ValueError):
            setattr(target, name, value)
    with pytest.warns(UserWarning, match="frozen_parameter"):
        torchair.get_npu_backend(compiler_config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())  # defaults: nothing to warn about
    with pytest.raises(TypeError, match="CompilerConfig"):
        torchair.get_npu_backend(compiler_config={"mode": "max-autotune"})
    assert torchair.CompilerConfig() == torchair.CompilerConfig() != config


class _Plain:
    def step(self, x):
        return x


class _Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)

    def step(self, x):
        return x @ self.w


def test_cache_compile_rules_and_layout(torchair, tmp_path):  # noqa: F811 (the fixture)
    m = _Twice()
    config = torchair.CompilerConfig()
    with pytest.raises(ValueError, match="Only method"):
        torchair.inference.cache_compile(lambda x: x, config=config)
    with pytest.raises(ValueError, match="torch.nn.Module method"):
        torchair.inference.cache_compile(_Plain().step)
    other = torchair.CompilerConfig()
    other.experimental_config.frozen_parameter = True
    with pytest.raises(ValueError, match="different from the config"):
        torchair.inference.cache_compile(m.step, config=config, backend=torchair.get_npu_backend(compiler_config=other))
    ref_data = torchair.CompilerConfig()
    ref_data.experimental_config.enable_ref_data = True
    with pytest.raises(ValueError, match="enable_ref_data"):
        torchair.inference.cache_compile(m.step, config=ref_data)
    cached = torchair.inference.cache_compile(m.step, config=config, dynamic=False, cache_dir=str(tmp_path))
    x = torch.randn(2, 4)
    assert torch.equal(cached(x), m.step(x))
    (path,) = tmp_path.glob("_Twice_static_*/step/compiled_module")
    assert cached.cache_bin == str(path.resolve())
