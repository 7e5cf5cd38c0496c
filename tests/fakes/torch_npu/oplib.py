"""Registering a fake op once per process, for the ops_*.py family modules that load as package modules.

A family module may load under two module names (the torch_npu package, and ops.py's stand-in package when a test
loads ops.py by path); the first load's kernels are the ones that run, and a second define() of the same schema
would fail. torch.library.Library unregisters its ops when it is garbage collected
(https://pytorch.org/docs/stable/library.html, torch.library.Library), so each one made here is kept in _LIBS.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

NAMESPACE = "fake_npu"
_LIBS: list[torch.library.Library] = []


def registered(name: str) -> bool:
    """Whether torch.ops.fake_npu.<name> exists already (an earlier load of the same family registered it)."""
    try:
        getattr(torch.ops.fake_npu, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def register_once(name: str, schema: str, kernel: Callable, meta: Callable) -> bool:
    """Define fake_npu::<name> with its compute kernel (CompositeExplicitAutograd: any device's tensors) and its
    Meta kernel (torch.compile's shape checks), unless it is defined already; returns whether it registered."""
    if registered(name):
        return False
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    lib.define(schema)
    lib.impl(name, kernel, "CompositeExplicitAutograd")
    lib.impl(name, meta, "Meta")
    _LIBS.append(lib)
    return True
