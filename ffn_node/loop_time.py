"""The FFN serving loop's time, split in two: compute, timed by device events and read once the device has
passed them (so the host never waits to time it), and idle, every other span of the loop on the host's
clock (the wait for a layer's inputs, sends, bookkeeping, the wait for the next step's headers). On CPU
the two clocks are one and compute + idle adds up to the loop's wall time; on a device, where the host
runs ahead, idle is the host's time outside issuing computes."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from afd.backend import Backend
from afd.dataplane.prefetch import PrefetchSchedule
from afd.observability.ffn_metrics import FFNMetrics
from afd.observability.timing import Timers

T = TypeVar("T")


class LoopTime:
    def __init__(self, backend: Backend, timers: Timers, metrics: FFNMetrics | None, prefetch: PrefetchSchedule | None):
        self.backend, self.timers, self.metrics, self.prefetch = backend, timers, metrics, prefetch
        self.mark = time.perf_counter()
        """Where the current idle span began: the end of the last compute, or of the last span accounted."""
        self._timed: deque = deque()
        """(layer, start, end, gap) device events of computes not yet accounted, oldest first; gap: the
        event before the layer's prefetch and wait (its span to start is the layer's gap), or None."""

    def restart(self) -> None:
        """Time spent outside the loop (a re-formation) is not the loop's."""
        self.mark = time.perf_counter()

    def idle(self, layer: int | None = None) -> float:
        """Accounts the span since the mark as idle (before `layer`'s compute, or between steps when
        None) and returns now, the next span's start."""
        now = time.perf_counter()
        span, self.mark = now - self.mark, now
        self.timers.add("idle", span)
        if self.metrics is not None:
            self.metrics.idle.observe(span)
            if layer is not None:
                self.metrics.layer_idle[layer] += span
        return now

    def compute(self, layer: int, gap, run: Callable[[], T]) -> T:
        """run() between two device events, accounted once the device has passed them (`account`)."""
        start, end = self.backend.timing_event(), self.backend.timing_event()
        start.record()
        out = run()
        end.record()
        self.mark = time.perf_counter()
        self._timed.append((layer, start, end, gap))
        return out

    def account(self) -> None:
        """Compute time from device events the device has passed (query(), never a wait): a synchronize per
        micro-batch would stall the host the exchange is meant to keep ahead."""
        while self._timed and self._timed[0][2].query():
            layer, start, end, gap = self._timed.popleft()
            seconds = start.elapsed_time(end) / 1000.0
            if gap is not None and self.prefetch is not None:
                self.prefetch.observe_gap(layer, gap.elapsed_time(start) / 1000.0)
            self.timers.add("compute", seconds)
            if self.metrics is not None:
                self.metrics.compute.observe(seconds)
                self.metrics.layer_compute[layer] += seconds
