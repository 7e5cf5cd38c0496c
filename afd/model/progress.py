"""Progress of long work (checkpoint loading, offline generation): a tqdm bar on a terminal, plain
periodic lines in a log, where a bar's carriage returns would only make noise."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("afd.progress")


class Progress:
    def __init__(self, total: int, desc: str, unit: str, enabled: bool = True, every_s: float = 10.0):
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.done, self._t0 = 0, time.monotonic()
        self._last = self._t0
        self._bar = None
        self.enabled = enabled and total > 0
        if self.enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled and time.monotonic() - self._last >= self.every_s:
            self._last = time.monotonic()
            self._line()

    def _line(self) -> None:
        dt = max(1e-9, time.monotonic() - self._t0)
        log.info(
            "%s: %d/%d %s (%.0f%%, %.1f %s/s)",
            self.desc,
            self.done,
            self.total,
            self.unit,
            100 * self.done / self.total,
            self.done / dt,
            self.unit,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and time.monotonic() - self._t0 >= self.every_s:  # a short job needs no last line
            self._line()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
