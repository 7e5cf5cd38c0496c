"""Choosing the number of ping-pong micro-batches from measured times.

With one micro-batch the exchange hides only behind the ScMoE window. When the round trip is longer,
MegaScale-Infer's rule says m micro-batches keep both sides busy if m >= 2 * (1 + T_comm / T_compute);
more than 4 shrinks the expert GEMMs for little gain, so m is capped there. Splitting also costs
(smaller GEMMs, more messages, per-op overhead), so the rule only proposes a candidate: the tuner
measures it against one micro-batch and keeps whichever ran faster.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque

from afd.dataplane.protocol import MAX_MICRO_BATCHES

HIDDEN_ENOUGH = 0.05
"""Exposed wait below this fraction of the step needs no ping-pong."""
DRIFT = 0.3
"""A choice is measured again when its steps' median per token moves this far (a fraction) from the one it was
made on: the machine's load, or the mix of sequences, changed enough that the other m may now be faster."""

log = logging.getLogger("afd.dataplane")


def micro_batches_rule(t_comm: float, t_compute: float) -> int:
    if t_compute <= 0:
        return MAX_MICRO_BATCHES
    return max(2, min(MAX_MICRO_BATCHES, math.ceil(2 * (1 + t_comm / t_compute))))


class MicroBatchTuner:
    """Measures `warmup` decode steps with m = 1; if the attention side waited for the FFN more than
    HIDDEN_ENOUGH of the time, runs the rule's m and m = 1 in alternating steps, `warmup` of each (so that a
    change in the machine's load falls on both), and keeps the one with the faster median step per token. The
    choice is logged with the medians behind it. It holds until the decode batch is twice as large or half as
    large as when it was made (a serving load changes), or until the chosen m's last `window` steps drift:
    their median per token more than DRIFT away from the one it was chosen on. Then it is measured again.

    T_comm is the time the attention side sat blocked on the FFN result (the exchange the window did
    not hide); T_compute is the rest of the step.
    """

    def __init__(self, warmup: int = 4, window: int = 32):
        self.warmup, self.window = warmup, window
        self._reset()

    def _reset(self) -> None:
        self.first: list[tuple[float, float, float]] = []  # m = 1's (step, wait, per token) before any split
        self.trials: dict[int, list[float]] = {}  # m -> seconds per token, the alternating steps'
        self.current = 1
        self.chosen: int | None = None
        self.batch: int | None = None
        self.basis = 0.0  # the chosen m's median seconds per token when it was chosen
        self.recent: deque[float] = deque(maxlen=self.window)

    @property
    def micro_batches(self) -> int:
        return self.chosen or self.current

    def observe(self, step_seconds: float, wait_seconds: float, is_decode: bool, tokens: int = 0) -> None:
        if not is_decode:
            return
        per_token = step_seconds / max(tokens, 1)
        if self.chosen is not None:
            self._hold(per_token, tokens)
            return
        self.batch = self.batch or tokens
        if not self.trials:
            self._first((step_seconds, wait_seconds, per_token))
            return
        self.trials[self.current].append(per_token)
        if all(len(s) >= self.warmup for s in self.trials.values()):
            medians = {m: statistics.median(s) for m, s in self.trials.items()}
            self._choose(min(medians, key=medians.__getitem__), medians)
            return
        others = [m for m in self.trials if m != self.current]
        self.current = others[0]

    def _first(self, sample: tuple[float, float, float]) -> None:
        self.first.append(sample)
        if len(self.first) < self.warmup:
            return
        steps, waits = sum(s[0] for s in self.first), sum(s[1] for s in self.first)
        if steps <= 0 or waits / steps < HIDDEN_ENOUGH:
            median = statistics.median(s[2] for s in self.first)
            log.info(
                "micro-batches: 1 (the exchange is hidden: the attention side waited %.1f%% of %d decode steps)",
                100 * waits / max(steps, 1e-12),
                len(self.first),
            )
            self._choose(1, {1: median}, quiet=True)
            return
        rule = micro_batches_rule(waits, steps - waits)
        self.trials = {rule: [], 1: []}
        self.current = rule

    def _choose(self, m: int, medians: dict[int, float], quiet: bool = False) -> None:
        self.chosen, self.basis = m, medians[m]
        self.recent.clear()
        if not quiet:
            figures = ", ".join(f"m={k}: {v * 1e3:.3f} ms" for k, v in sorted(medians.items()))
            log.info(
                "micro-batches: %d (median decode step per token over %d alternating steps each: %s; batch %s)",
                m,
                self.warmup,
                figures,
                self.batch,
            )

    def _hold(self, per_token: float, tokens: int) -> None:
        if tokens and self.batch and not self.batch / 2 < tokens < self.batch * 2:
            log.info("micro-batches: measured again (the decode batch went from %d to %d)", self.batch, tokens)
            self._reset()
            return
        self.recent.append(per_token)
        if len(self.recent) < self.window or self.basis <= 0:
            return
        now = statistics.median(self.recent)
        if abs(now / self.basis - 1) > DRIFT:
            log.info(
                "micro-batches: measured again (a decode step per token drifted from %.3f to %.3f ms at m=%d)",
                self.basis * 1e3,
                now * 1e3,
                self.chosen,
            )
            self._reset()
