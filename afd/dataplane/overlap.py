"""Choosing the number of ping-pong micro-batches from measured times.

With one micro-batch the exchange hides only behind the ScMoE window. When the round trip is longer,
MegaScale-Infer's rule says m micro-batches keep both sides busy if m >= 2 * (1 + T_comm / T_compute);
more than 4 shrinks the expert GEMMs for little gain, so m is capped there. Splitting also costs
(smaller GEMMs, more messages, per-op overhead), so the rule only proposes a candidate: the tuner
measures it against one micro-batch and keeps whichever ran faster.
"""

from __future__ import annotations

import math
import statistics

from afd.dataplane.protocol import MAX_MICRO_BATCHES

HIDDEN_ENOUGH = 0.05
"""Exposed wait below this fraction of the step needs no ping-pong."""


def micro_batches_rule(t_comm: float, t_compute: float) -> int:
    if t_compute <= 0:
        return MAX_MICRO_BATCHES
    return max(2, min(MAX_MICRO_BATCHES, math.ceil(2 * (1 + t_comm / t_compute))))


class MicroBatchTuner:
    """Measures `warmup` decode steps with m = 1; if the attention side waited for the FFN more than
    HIDDEN_ENOUGH of the time, measures the rule's m as many steps and keeps the faster. A choice holds
    until the decode batch is twice as large or half as large as when it was made (a serving load
    changes); then it is measured again.

    T_comm is the time the attention side sat blocked on the FFN result (the exchange the window did
    not hide); T_compute is the rest of the step.
    """

    def __init__(self, warmup: int = 4):
        self.warmup = warmup
        self._reset()

    def _reset(self) -> None:
        self.trials: dict[int, list[tuple[float, float]]] = {1: []}
        self.current = 1
        self.chosen: int | None = None
        self.batch: int | None = None

    @property
    def micro_batches(self) -> int:
        return self.chosen or self.current

    def observe(self, step_seconds: float, wait_seconds: float, is_decode: bool, tokens: int = 0) -> None:
        if not is_decode:
            return
        if self.chosen is not None:
            if tokens and self.batch and not self.batch / 2 < tokens < self.batch * 2:
                self._reset()
            return
        self.batch = self.batch or tokens
        samples = self.trials[self.current]
        samples.append((step_seconds, wait_seconds))
        if len(samples) < self.warmup:
            return
        if self.current == 1:
            step = sum(s for s, _ in samples)
            wait = sum(w for _, w in samples)
            if step <= 0 or wait / step < HIDDEN_ENOUGH:
                self.chosen = 1
            else:
                self.current = micro_batches_rule(wait, step - wait)
                self.trials[self.current] = []
            return
        self.chosen = min(self.trials, key=lambda m: statistics.median(s for s, _ in self.trials[m]))
