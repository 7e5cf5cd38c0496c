"""How the attention side reaches the MoE half: in-process, or over the data plane.

The runner sees one interface: `begin_step` with the token count of each micro-batch, then per layer
and micro-batch `submit(m)` returning a handle whose `wait()` gives the MoE output. Calls come in
(layer, micro-batch) order, which is also the order of messages on the wire.
"""

from __future__ import annotations

from typing import Protocol

import torch

from afd.backend import Backend
from afd.model.ffn_half import FFNHalf


class MoEHandle(Protocol):
    def wait(self) -> torch.Tensor: ...


class MoEExchange(Protocol):
    def begin_step(self, tokens_per_micro_batch: list[int]) -> None: ...

    def submit(self, layer: int, micro_batch: int, m: torch.Tensor) -> MoEHandle: ...

    def end_step(self) -> None: ...


class Ready:
    """A handle whose result is already there."""

    def __init__(self, y: torch.Tensor):
        self._y = y

    def wait(self) -> torch.Tensor:
        return self._y


class LocalMoE:
    """The colocated reference: the FFN half runs in this process, synchronously."""

    def __init__(self, ffn: FFNHalf, backend: Backend):
        self.ffn, self.backend = ffn, backend

    def begin_step(self, tokens_per_micro_batch: list[int]) -> None:
        pass

    def submit(self, layer: int, micro_batch: int, m: torch.Tensor) -> MoEHandle:
        return Ready(self.ffn(self.backend, layer, m))

    def end_step(self) -> None:
        pass
