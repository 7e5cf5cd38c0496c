"""Fake torchair, for tests only: CompilerConfig, get_npu_backend and inference.cache_compile with torchair's
signatures and documented rules; the "compiled" graph runs eagerly (plain torch), so results compare numerically.

Modelled release: torchair 7.1.0 (shipped with Ascend Extension for PyTorch 7.1.0, torch_npu 2.6.0).
Load it under the name "torchair" (tests/fake_ops_helpers.py does, with a "torch_npu" module already in
sys.modules).
"""

from __future__ import annotations

import functools
import sys
import warnings

import torch

from .configs.compiler_config import REDUCE_OVERHEAD_UNSUPPORTED as _REDUCE_OVERHEAD_UNSUPPORTED
from .configs.compiler_config import CompilerConfig

# source: TorchAir 安装 (installation), https://www.hiascend.com/document/detail/zh/Pytorch/720/modthirdparty/
#   torchairuseguide/torchair_00004.html, Ascend Extension for PyTorch 7.2.0 (7.1.0's page says the same):
#   "模型脚本中必须先import torch_npu，再import torchair" -- torch_npu must be imported before torchair.
# The same page limits torchair 7.1.0 and earlier to PyTorch 2.1.0 (7.2.0 lifts it); this fake does not
# enforce that, since it runs on the test machine's torch.
if "torch_npu" not in sys.modules:
    raise ImportError("torchair: import torch_npu before torchair (TorchAir installation guide)")

from . import inference  # noqa: E402  (after the import-order rule, like the real package's submodules)

__all__ = ["CompilerConfig", "get_npu_backend", "get_compiler", "inference"]

# torchair's converter for npu_prefetch refuses a missing dependency while the graph is built.
# source: npu_prefetch GE converter, https://github.com/Ascend/torchair/blob/7.1.0/python/torchair/
#   _ge_concrete_graph/ge_converter/custom/npu_prefetch.py, torchair 7.1.0
_PREFETCH_NO_DEPENDENCY = "torch.ops.npu.npu_prefetch.default ge converter is not implement when dependency is None."


def _op_name(target) -> str | None:
    if isinstance(target, torch._ops.OpOverload):
        return target.name().split("::")[-1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return None


def _convert_checks(gm: torch.fx.GraphModule) -> None:
    """The refusals torchair's FX-to-graph converters make for the ops afd uses."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or _op_name(node.target) != "npu_prefetch":
            continue
        dependency = node.args[1] if len(node.args) > 1 else node.kwargs.get("dependency")
        max_size = node.args[2] if len(node.args) > 2 else node.kwargs.get("max_size")
        if dependency is None:
            raise NotImplementedError(_PREFETCH_NO_DEPENDENCY)
        if isinstance(max_size, int) and max_size <= 0:
            raise ValueError(f"max_size should be greater than zero, but got {max_size}")


def _check_config_support(config: CompilerConfig) -> None:
    # torchair 7.1.0 (compiler_config._check_config_support) warns about options that may not take effect in
    # reduce-overhead mode; this fake warns only when such an option is actually set.
    if config.mode != "reduce-overhead":
        return
    leaves = config.leaves()
    bad = [f"config.{k}:{leaves[k]}" for k, vals in _REDUCE_OVERHEAD_UNSUPPORTED.items() if leaves[k] in vals]
    if bad:
        warnings.warn(
            "The following torchair config or properties may not take effect or report error in "
            f"reduce-overhead mode: {', '.join(bad)}",
            UserWarning,
            stacklevel=3,
        )


def _npu_backend(gm: torch.fx.GraphModule, example_inputs, *, compiler_config: CompilerConfig, decompositions: dict):
    _convert_checks(gm)
    return gm.forward  # "compiled": the captured graph, run eagerly with the fake ops


def get_compiler(compiler_config: CompilerConfig | None = None):
    """torchair.get_compiler: the (gm, example_inputs) compiler that get_npu_backend wraps."""
    return functools.partial(_npu_backend, compiler_config=_config_or_default(compiler_config), decompositions={})


def _config_or_default(compiler_config) -> CompilerConfig:
    if compiler_config is None:
        return CompilerConfig()
    if not isinstance(compiler_config, CompilerConfig):
        raise TypeError(f"compiler_config must be a torchair CompilerConfig, got {type(compiler_config).__name__}")
    return compiler_config


# custom_decompositions={} is torchair's own default (read, never mutated).
def get_npu_backend(*, compiler_config: CompilerConfig | None = None, custom_decompositions: dict = {}):  # noqa: B006
    """torchair.get_npu_backend: a torch.compile backend. As in torchair, a functools.partial whose keywords
    hold the compiler_config (cache_compile reads it from there)."""
    # source: npu_fx_compiler.get_npu_backend, https://github.com/Ascend/torchair/blob/7.1.0/python/torchair/
    #   npu_fx_compiler.py, torchair 7.1.0
    config = _config_or_default(compiler_config)
    _check_config_support(config)
    return functools.partial(_npu_backend, compiler_config=config, decompositions=dict(custom_decompositions))
