"""Fake torchair.inference.cache_compile, for tests only: torchair's checks and cache layout, no real cache.

source: cache_compile, https://www.hiascend.com/document/detail/zh/Pytorch/710/modthirdparty/torchairuseguide/
  torchair_00080.html, Ascend Extension for PyTorch 7.1.0
source: torchair/inference/_cache_compiler.py (cache_compile, CompiledModel.get_cache_bin),
  https://github.com/Ascend/torchair/blob/7.1.0/python/torchair/inference/_cache_compiler.py, torchair 7.1.0
source: the same file (ModelCacheSaver: torch.compile(..., fullgraph=True); save_compiled_fn: one compiled code
  per function, "Skip cache as ... recompiled"; LazyCompiledModel.compile / CompiledModel.rebase: a found cache
  runs without guards), read at commit 0208753d of https://github.com/Ascend/torchair
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import types
import warnings

import torch

__all__ = ["cache_compile"]

CACHE_FILE = "compiled_module"  # CompiledModel.FILE in torchair 7.1.0


def _cache_bin(func, config, dynamic: bool, cache_dir, global_rank, tp_rank, pp_rank, ge_cache: bool) -> str:
    """<cache_dir>/<Class>_<dynamic|static>[_gecache]_<md5>/<dist dir>/<method name>/compiled_module, as
    torchair 7.1.0 lays it out (the md5 keys the module's repr and the config)."""
    cache_dir = cache_dir or os.getenv("TORCHAIR_CACHE_HOME", os.path.join(os.getcwd(), ".torchair_cache"))
    module = func.__self__
    key = str(module) + json.dumps(config.leaves(), sort_keys=True, default=str)
    dist = []
    if (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    ):
        rank = torch.distributed.get_rank() if global_rank is None else global_rank
        dist.append(f"world{torch.distributed.get_world_size()}global_rank{rank}")
    if tp_rank is not None:
        dist.append(f"tp_rank{tp_rank}")
    if pp_rank is not None:
        dist.append(f"pp_rank{pp_rank}")
    parts = [type(module).__name__, "dynamic" if dynamic else "static"] + (["gecache"] if ge_cache else [])
    parts.append(hashlib.md5(key.encode()).hexdigest())
    return os.path.realpath(os.path.join(cache_dir, "_".join(parts), "_".join(dist), func.__name__, CACHE_FILE))


def _signature(args, kwargs) -> list[str]:
    """What a compiled graph is specialized on, per input leaf: a tensor's shape and dtype, any other value."""
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    return [f"{tuple(x.shape)}:{x.dtype}" if isinstance(x, torch.Tensor) else repr(x) for x in leaves]


class _LazyCompiled:
    """Compiles on the first call (torchair compiles or loads the cache then) and records the cache file.

    The rules of torchair 7.1.0's _cache_compiler.py this fake keeps (the real cache holds a GE graph; this
    one the inputs it was made for):
    - ModelSaver compiles with torch.compile(func, fullgraph=True, dynamic=dynamic): a graph break fails.
    - ModelCacheSaver.save_compiled_fn keeps one compiled code per cached function: on a second one (a
      recompile: other shapes, other constants) it warns "Skip cache as ... recompiled" and removes the
      cache directory.
    - A cache file found at the first call is loaded (CompiledModel.load) and rebased onto the module
      (CompiledModel.rebase): its graph then runs for every call with no dynamo guard. The real one silently
      computes with the cached graph whatever the inputs; this fake raises when a call's inputs differ from
      those the cache was made for, so that a test sees it.
    """

    def __init__(self, func, config, dynamic: bool, cache_bin_args: tuple):
        self.func, self.config, self.dynamic, self._args = func, config, dynamic, cache_bin_args
        self.cache_bin: str | None = None
        self.loaded = False
        """Whether the first call found the cache (no compile)."""
        self.graphs = 0
        """Graphs compiled for this function (a second one is a recompile)."""
        self._compiled = None
        self._cached_inputs: list[str] | None = None

    def __call__(self, *args, **kwargs):
        sig = _signature(args, kwargs)
        if self._compiled is None:
            self._first_call(sig)
        if self.loaded and sig != self._cached_inputs:
            raise RuntimeError(
                f"torchair cache_compile: {self.cache_bin} holds a graph compiled for other inputs "
                f"({self._cached_inputs} != {sig}); torchair would run it unguarded"
            )
        out = self._compiled(*args, **kwargs)
        if self.graphs > 1 and self.cache_bin is not None:
            warnings.warn(
                f"Skip cache as {self.func.__qualname__} recompiled, set torch._logging.set_logs("
                "recompiles=True) for details",
                UserWarning,
                stacklevel=2,
            )
            shutil.rmtree(os.path.dirname(self.cache_bin), ignore_errors=True)
            self.cache_bin = None
        return out

    def _first_call(self, sig: list[str]) -> None:
        from . import get_npu_backend

        self.cache_bin = _cache_bin(self.func, self.config, self.dynamic, *self._args)
        if os.path.exists(self.cache_bin):
            with open(self.cache_bin) as f:
                self._cached_inputs, self.loaded = json.load(f)["inputs"], True
        else:
            os.makedirs(os.path.dirname(self.cache_bin), exist_ok=True)
            with open(self.cache_bin, "w") as f:
                json.dump(
                    {"func": self.func.__qualname__, "config": self.config.leaves(), "inputs": sig}, f, default=str
                )
        backend = get_npu_backend(compiler_config=self.config)

        def counting(gm, example_inputs):
            self.graphs += 1
            return backend(gm, example_inputs)

        self._compiled = torch.compile(self.func, backend=counting, dynamic=self.dynamic, fullgraph=True)


def cache_compile(
    func,
    *,
    config=None,
    backend=None,
    dynamic: bool = True,
    cache_dir: str | None = None,
    global_rank: int | None = None,
    tp_rank: int | None = None,
    pp_rank: int | None = None,
    ge_cache: bool = False,
    **kwargs,
):
    """torchair.inference.cache_compile (7.1.0 prototype; note dynamic defaults to True)."""
    from . import _config_or_default

    # doc: with both config and backend, the backend's config must be the same; with backend only, its config.
    if backend is not None:
        backend_config = backend.keywords.get("compiler_config")
        if config is not None and backend_config != config:
            raise ValueError("config in current backend is different from the config during cache generation.")
        config = backend_config
    config = _config_or_default(config)
    # source code 7.1.0: only a bound method of a torch.nn.Module can be cached.
    if not isinstance(func, types.MethodType):
        raise ValueError(f"Only method can be cached now, got {func}")
    if not isinstance(func.__self__, torch.nn.Module):
        raise ValueError(f"Only torch.nn.Module method can be cached now, got {func}")
    # source code 7.1.0: an existing cache_dir must belong to the current user.
    if cache_dir is not None and os.path.exists(cache_dir) and os.stat(cache_dir).st_uid != os.getuid():
        raise ValueError(f"Cache dir {cache_dir} must be owned by the current user ")
    # doc: not supported together with RefData conversion (experimental_config.enable_ref_data).
    if config.experimental_config.enable_ref_data:
        raise ValueError("cache_compile does not support experimental_config.enable_ref_data=True")
    # torchair 7.1.0 warns that cache_compile may not take effect in reduce-overhead mode.
    if config.mode == "reduce-overhead":
        warnings.warn(
            "The following torchair config or properties may not take effect or report error in "
            "reduce-overhead mode: cache_compile",
            UserWarning,
            stacklevel=2,
        )
    return _LazyCompiled(func, config, dynamic, (cache_dir, global_rank, tp_rank, pp_rank, ge_cache))
