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
