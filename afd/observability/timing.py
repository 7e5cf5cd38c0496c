"""Accumulating timers for the per-layer AFD figures: time blocked on the exchange, compute, idle."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Timer:
    total: float = 0.0
    count: int = 0

    def add(self, seconds: float) -> None:
        self.total += seconds
        self.count += 1


@dataclass
class Timers:
    """Named accumulating timers."""

    timers: dict[str, Timer] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.timers.setdefault(name, Timer()).add(seconds)

    def total(self, name: str) -> float:
        t = self.timers.get(name)
        return t.total if t else 0.0


@dataclass
class LayerTimes:
    """Per-call seconds of the attention side's pieces of each layer, kept only when a runner is given one
    (`afd profile`: afd.plan.profile_measure); the serving path keeps none. Pieces: `pre` (pre_moe, up to the
    MoE input), `window` (post_moe: what runs while the MoE input is away), `combine` (adding the MoE output),
    `dense` (a dense layer's pre_moe, which has no MoE input), and `moe` (the exchange's submit: the FFN half
    itself under the in-process exchange). Host clock: on a device backend a piece's time is its launches,
    not its kernels, unless the caller synchronizes."""

    samples: list[tuple[str, int, int, float]] = field(default_factory=list)
    """(piece, layer, tokens, seconds) per call, in call order."""

    def add(self, piece: str, layer: int, tokens: int, seconds: float) -> None:
        self.samples.append((piece, layer, tokens, seconds))
