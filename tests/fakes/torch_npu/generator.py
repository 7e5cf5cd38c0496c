"""`torch.Generator(device="npu:N")` on the fake device, and ATen's check of a random op's generator.

torch_npu makes an NPU generator through the PrivateUse1 hooks' getNewGenerator (its own tests build one
with `torch.Generator(device="npu:0")`). The Python hooks PyTorch offers a PrivateUse1 backend
(torch._C._acc.PrivateUse1Hooks) have no getNewGenerator, so `install` wraps `torch.Generator`: for an npu
device it makes a CPU generator (the fake's ops run on CPU payloads) that reports the npu device; any other
device gets PyTorch's own generator, and isinstance checks against `torch.Generator` still hold for every
generator. What is checked is what ATen checks (check_generator, aten/src/ATen/core/Generator.h): a random
op on npu tensors given a generator of another device type raises, as on the device. The dispatcher hands an
op a new Python wrapper of the generator, so an npu generator is recognised by its state (equal to a live npu
generator's); a CPU generator in exactly the state of an npu one would pass.
"""

from __future__ import annotations

import weakref

import torch

_Generator = torch.Generator
_npu: weakref.WeakSet = weakref.WeakSet()


class _Meta(type(_Generator)):  # type: ignore[misc]
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, _Generator)


class Generator(_Generator, metaclass=_Meta):  # type: ignore[misc,valid-type]
    def __new__(cls, device="cpu"):
        from .device import current_device

        d = torch.device(device)
        if d.type != "npu":
            return _Generator(d)
        g = super().__new__(cls, "cpu")
        g._npu = torch.device("npu", current_device() if d.index is None else d.index)
        _npu.add(g)
        return g

    def __init__(self, device="cpu") -> None:
        pass

    @property
    def device(self) -> torch.device:
        return self._npu


def check(func, leaves: list) -> None:
    """An op on npu tensors: every generator among its arguments must be an npu one."""
    for g in leaves:
        if isinstance(g, _Generator) and not _is_npu(g):
            raise RuntimeError(f"{func}: Expected a 'npu' device type for generator but found '{g.device.type}'")


def _is_npu(g: torch.Generator) -> bool:
    state = g.get_state()
    return any(torch.equal(state, n.get_state()) for n in list(_npu))


def install() -> None:
    torch.Generator = Generator  # type: ignore[misc]
