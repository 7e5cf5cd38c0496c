"""How many bytes one layer's prefetch may hint: the rule of docs/design/longcat-on-ascend.md#weight-prefetch,
with the gap measured.

That rule: the most a prefetch can move while another operator runs is the memory bandwidth times the time
available; only what the cache keeps is still there when the GEMM reads it. On the FFN node the time available
is the gap before layer l's compute: the wait for its inputs (docs/design/longcat-on-ascend.md#ffn-prefetch).
So, per layer,

    budget(l) = min(bandwidth x gap(l), cache_bytes)

with gap(l) a running estimate of the measured waits (the FFN server times each layer's wait with device
events, so measuring never makes the host wait) and bandwidth and cache_bytes the backend's figures
(Backend.prefetch_spec). A layer never measured yet gets no hint: nothing says there is a gap to fill.
"""

from __future__ import annotations

from afd.backend.base import PrefetchSpec

SMOOTHING = 0.25
"""Weight of the newest gap in the running estimate: a few steps follow a change of load, one slow wait
(a peer's hiccup) moves the budget by a quarter."""


class GapBudget:
    def __init__(self, spec: PrefetchSpec, fixed_bytes: int | None = None, smoothing: float = SMOOTHING):
        """fixed_bytes: the YAML's override (prefetch.budget_bytes); None: computed from the gaps."""
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.spec, self.fixed, self.smoothing = spec, fixed_bytes, smoothing
        self.gap: dict[int, float] = {}
        """Seconds: the running estimate of each layer's wait for its inputs."""

    def observe(self, layer: int, seconds: float) -> None:
        """One measured wait for `layer`'s inputs."""
        seconds = max(seconds, 0.0)
        old = self.gap.get(layer)
        self.gap[layer] = seconds if old is None else old + self.smoothing * (seconds - old)

    def __call__(self, layer: int) -> int:
        """Bytes layer `layer`'s hints may cover."""
        if self.fixed is not None:
            return self.fixed
        movable = self.spec.bandwidth * self.gap.get(layer, 0.0)
        return int(min(movable, self.spec.cache_bytes))
