"""Fake torchair.inference.cache_compile, for tests only: torchair's checks and cache layout, no real cache.

source: cache_compile, https://www.hiascend.com/document/detail/zh/Pytorch/710/modthirdparty/torchairuseguide/
  torchair_00080.html, Ascend Extension for PyTorch 7.1.0
source: torchair/inference/_cache_compiler.py (cache_compile, CompiledModel.get_cache_bin),
  https://github.com/Ascend/torchair/blob/7.1.0/python/torchair/inference/_cache_compiler.py, torchair 7.1.0
"""

from __future__ import annotations

import hashlib
import json
import os
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
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        rank = torch.distributed.get_rank() if global_rank is None else global_rank
        dist.append(f"world{torch.distributed.get_world_size()}global_rank{rank}")
    if tp_rank is not None:
        dist.append(f"tp_rank{tp_rank}")
    if pp_rank is not None:
        dist.append(f"pp_rank{pp_rank}")
    parts = [type(module).__name__, "dynamic" if dynamic else "static"] + (["gecache"] if ge_cache else [])
    parts.append(hashlib.md5(key.encode()).hexdigest())
    return os.path.realpath(os.path.join(cache_dir, "_".join(parts), "_".join(dist), func.__name__, CACHE_FILE))


class _LazyCompiled:
    """Compiles on the first call (torchair compiles or loads the cache then) and records the cache file."""

    def __init__(self, func, config, dynamic: bool, cache_bin_args: tuple):
        self.func, self.config, self.dynamic, self._args = func, config, dynamic, cache_bin_args
        self.cache_bin: str | None = None
        self._compiled = None

    def __call__(self, *args, **kwargs):
        if self._compiled is None:
            from . import get_npu_backend

            self.cache_bin = _cache_bin(self.func, self.config, self.dynamic, *self._args)
            os.makedirs(os.path.dirname(self.cache_bin), exist_ok=True)
            with open(self.cache_bin, "w") as f:
                json.dump({"func": self.func.__qualname__, "config": self.config.leaves()}, f, default=str)
            self._compiled = torch.compile(self.func, backend=get_npu_backend(compiler_config=self.config),
                                           dynamic=self.dynamic)
        return self._compiled(*args, **kwargs)


def cache_compile(func, *, config=None, backend=None, dynamic: bool = True, cache_dir: str | None = None,
                  global_rank: int | None = None, tp_rank: int | None = None, pp_rank: int | None = None,
                  ge_cache: bool = False, **kwargs):
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
        warnings.warn("The following torchair config or properties may not take effect or report error in "
                      "reduce-overhead mode: cache_compile", UserWarning, stacklevel=2)
    return _LazyCompiled(func, config, dynamic, (cache_dir, global_rank, tp_rank, pp_rank, ge_cache))
