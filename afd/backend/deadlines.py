"""Deadlines for communication the host does not wait for.

On NCCL and HCCL a wait is stream-ordered: the consumer's stream waits for the transfer and the host goes
on issuing work, so no wait on the hot path can time out. A watchdog thread holds the deadline of every
such wait instead: it polls `work.is_completed()` (a host-side query, never a sync) and, once a deadline
passes, records the owner's PeerError and calls `on_expired(peer)`, which aborts that peer's (or group's)
communicators so the queued device work fails instead of hanging. The owner thread meets the error at its
next `check()`: after each step's one host read, where an aborted step's results would otherwise be used.
Its owners: the data plane (afd.dataplane.transport, per peer) and an attention node's TP group
(afd.model.tp.comm).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from afd.backend.base import PeerError

log = logging.getLogger("afd.deadlines")


class Deadlines:
    def __init__(
        self,
        timeout_s: float,
        on_expired: Callable[[int], None],
        error: Callable[[str, int, float], PeerError],
        poll_s: float = 0.05,
    ):
        """error(what, peer, timeout_s): the PeerError a passed deadline raises at `check` (a TP group's
        names its group, not a peer rank)."""
        self.timeout_s, self.on_expired, self.poll_s, self.error = timeout_s, on_expired, poll_s, error
        self._pending: list[tuple[float, object, int, str]] = []
        self._failures: dict[int, PeerError] = {}
        self._mu = threading.Lock()
        self._expiring = threading.Lock()
        """Held by the watchdog from taking an expired work to the end of its on_expired: `forget` waits for
        an abort under way, which would otherwise land on the pair that replaces the peer's."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="afd-deadlines", daemon=True)
        self._thread.start()

    def watch(self, work, peer: int, what: str) -> None:
        """`work` must complete within the timeout from now."""
        with self._mu:
            self._pending.append((time.monotonic() + self.timeout_s, work, peer, what))

    def check(self, peer: int | None = None) -> None:
        """Raises the PeerError of a deadline that passed (`peer`'s, or any peer's with None; each once)."""
        with self._mu:
            if peer is None:
                peer = next(iter(self._failures), None)
            failure = self._failures.pop(peer, None) if peer is not None else None
        if failure is not None:
            raise failure

    def forget(self, peer: int) -> bool:
        """Stops watching `peer`'s works and drops its recorded failure (its pair is replaced or gone);
        returns whether any of those works had not completed: work that may still be queued. Returns once
        an abort that a passed deadline of the peer's started has ended."""
        with self._expiring, self._mu:
            mine = [e for e in self._pending if e[2] == peer]
            self._pending = [e for e in self._pending if e[2] != peer]
            self._failures.pop(peer, None)
        return any(not _completed(e[1]) for e in mine)

    def oldest(self, peer: int) -> float | None:
        """When the oldest incomplete transfer with `peer` began (time.monotonic), or None."""
        with self._mu:
            starts = [d - self.timeout_s for d, work, p, _ in self._pending if p == peer and not _completed(work)]
        return min(starts, default=None)

    @property
    def pending(self) -> int:
        """Watched works not completed yet: work that may still be queued on the device."""
        with self._mu:
            return sum(1 for entry in self._pending if not _completed(entry[1]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.poll_s + 1)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._expiring:
                self._poll()

    def _poll(self) -> None:
        now, expired = time.monotonic(), None
        with self._mu:
            live = []
            for entry in self._pending:
                deadline, work, peer, what = entry
                if _completed(work):
                    continue
                if expired is None and now > deadline:
                    expired = entry
                else:
                    live.append(entry)
            if expired is not None:
                _, _, peer, what = expired
                live = [e for e in live if e[2] != peer]  # the abort fails the rest of that peer's work
                if peer not in self._failures:
                    self._failures[peer] = self.error(what, peer, self.timeout_s)
            self._pending = live
        if expired is not None:
            log.warning("deadline passed: %s with rank %d; aborting its communicators", expired[3], expired[2])
            try:
                self.on_expired(expired[2])
            except Exception as e:  # the error is recorded either way; the abort is best effort
                log.warning("abort after a deadline failed: %s", e)


def _completed(work) -> bool:
    try:
        return bool(work.is_completed())
    except RuntimeError:  # a failed work is done: its error surfaces where it is waited for
        return True
