"""Modules built without storage: every half is built on the meta device, then filled from a checkpoint."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypeVar

import torch
from torch.overrides import TorchFunctionMode

M = TypeVar("M", bound=torch.nn.Module)


class _NoInitOnMeta(TorchFunctionMode):
    """torch.nn.init's functions do nothing to a meta tensor (there is nothing to fill), yet on meta they
    run through torch's reference implementations, and the first call imports torch._dynamo: 1.4 s of
    every node's start-up for a result that is thrown away. Function modes are per thread, so another
    thread's initialisation is untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Modules constructed inside are on the meta device, their parameters left uninitialised."""
    with torch.device("meta"), _NoInitOnMeta():
        yield


def materialize(module: M) -> M:
    """`module.to_empty(device="cpu")`, but by torch.empty: to_empty's empty_like of a meta tensor runs
    through torch's reference implementations, which import sympy (0.6 s of a node's start-up)."""
    return module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype))
