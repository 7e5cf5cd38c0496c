"""Choosing the number of ping-pong micro-batches from measured times (MegaScale-Infer's rule).

With one micro-batch the exchange hides only behind the ScMoE window. When the round trip is longer,
m micro-batches keep both sides busy if m >= 2 * (1 + T_comm / T_compute); more than 4 shrinks the
expert GEMMs for little gain, so m is capped there.
"""

from __future__ import annotations

import math

from afd.protocol import MAX_MICRO_BATCHES

HIDDEN_ENOUGH = 0.05
"""Exposed wait below this fraction of the step needs no ping-pong."""


def micro_batches_rule(t_comm: float, t_compute: float) -> int:
    if t_compute <= 0:
        return MAX_MICRO_BATCHES
    return max(2, min(MAX_MICRO_BATCHES, math.ceil(2 * (1 + t_comm / t_compute))))


class MicroBatchTuner:
    """Runs `warmup` decode steps with one micro-batch, then fixes m from what they measured.

    T_comm is the time the attention side sat blocked on the FFN result (the exchange that the window
    did not hide); T_compute is the rest of the step.
    """

    def __init__(self, warmup: int = 4):
        self.warmup = warmup
        self.samples: list[tuple[float, float]] = []
        self.chosen: int | None = None

    @property
    def micro_batches(self) -> int:
        return self.chosen or 1

    def observe(self, step_seconds: float, wait_seconds: float, is_decode: bool) -> None:
        if self.chosen is not None or not is_decode:
            return
        self.samples.append((step_seconds, wait_seconds))
        if len(self.samples) >= self.warmup:
            step = sum(s for s, _ in self.samples)
            wait = sum(w for _, w in self.samples)
            hidden = step <= 0 or wait / step < HIDDEN_ENOUGH
            self.chosen = 1 if hidden else micro_batches_rule(wait, step - wait)
