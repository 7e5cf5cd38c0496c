"""Accumulating timers for the per-layer AFD figures: time blocked on the exchange, compute, idle."""

from __future__ import annotations

import time
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
    """Named timers; `span(name)` times a with-block."""

    timers: dict[str, Timer] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.timers.setdefault(name, Timer()).add(seconds)

    def total(self, name: str) -> float:
        t = self.timers.get(name)
        return t.total if t else 0.0

    def span(self, name: str):
        return _Span(self, name)

    def as_dict(self) -> dict[str, float]:
        return {k: v.total for k, v in self.timers.items()}


class _Span:
    def __init__(self, timers: Timers, name: str):
        self.timers, self.name = timers, name

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.timers.add(self.name, time.perf_counter() - self.t0)
