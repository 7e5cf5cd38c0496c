"""Restarting a node that fails: the policy of `afd launch`, `afd serve` and afd.LLM's local cluster.

A process that exits non-zero (or is killed) is started again with its own command after a back-off:
`cluster.restart_backoff` seconds, doubled for each next restart of a row, at most BACKOFF_CAP. A row
ends when the restarted process stays up for `reset_after` seconds (the cluster's `startup_timeout`:
longer than a start may take, so it had started). Past `cluster.max_restarts` restarts in a row the
launcher gives up and stops the cluster. A process that exits 0 was asked to (SIGTERM, a cluster
shutdown) and is not restarted.

A restart waits, bounded by `port_wait`, for the dead process's ports to be free (a process it left
behind, or a socket the kernel still holds): the launcher's "ports are free" check is for the first
start only, so a restart is never mistaken for another cluster on the same ports. Ports still taken
after that wait count as a failed restart of the row.

Every restart hands the new process the number of times its node was restarted so far in
RESTARTS_ENV; the node exports it as `afd_node_restarts_total{node}` on its own /metrics
(afd.observability.metrics), since the launcher has no port of its own to be scraped on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from afd.cluster.host import busy

RESTARTS_ENV = "AFD_NODE_RESTARTS"
BACKOFF_CAP = 30.0
"""Seconds at most between two restarts of a row."""


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5
    """Restarts in a row of one process before giving up (0: none)."""
    backoff: float = 1.0
    """Seconds before the first restart of a row; doubled for each next one, up to BACKOFF_CAP."""
    reset_after: float = 120.0
    """Seconds a restarted process must stay up for its next failure to start a new row."""
    port_wait: float = 30.0
    """Seconds a restart waits for the dead process's ports to be free."""

    @classmethod
    def of(cls, cluster) -> RestartPolicy:
        """The policy of a cluster YAML's `cluster` section (afd.config.schema.ClusterSection)."""
        return cls(cluster.max_restarts, cluster.restart_backoff, cluster.startup_timeout)

    def delay(self, row: int) -> float:
        """Seconds before restart number `row` (0: the first) of a row."""
        return min(BACKOFF_CAP, self.backoff * 2 ** min(row, 32))


class GiveUp(RuntimeError):
    """A process failed once more than the policy allows; the message says why, in one line."""

    def __init__(self, name: str, why: str):
        super().__init__(why)
        self.name = name


@dataclass
class _Record:
    started: float
    """When the process last started (time.monotonic)."""
    total: int = 0
    """Restarts of this process so far: what RESTARTS_ENV tells the next one."""
    row: int = 0
    """Restarts in the current row (back-off and limit)."""
    due: float | None = None
    """When its pending restart is due; None: none pending."""
    ports_free_by: float = 0.0
    """When a due restart stops waiting for the ports."""


class Supervisor:
    """The restart bookkeeping of one launcher's processes (afd.cluster.processes.NodeProcesses drives it:
    `failed` when it sees a process dead, `due` on every poll, `started` on every start), by unit: the
    processes that restart together (a node's TP ranks), named by the node. `say` logs."""

    def __init__(self, policy: RestartPolicy, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
        self.policy, self.say, self.clock = policy, say, clock
        self.records: dict[str, _Record] = {}
        self._left: set[str] = set()

    def started(self, unit: str, process: str | None = None) -> None:
        rec = self.records.setdefault(unit, _Record(self.clock()))
        rec.started, rec.due = self.clock(), None
        self._left.discard(process or unit)

    def left(self, process: str) -> bool:
        """Whether `process` exited 0 since its last start and this is the first time it is asked."""
        first = process not in self._left
        self._left.add(process)
        return first

    def pending(self, name: str) -> bool:
        rec = self.records.get(name)
        return rec is not None and rec.due is not None

    @property
    def any_pending(self) -> bool:
        return any(r.due is not None for r in self.records.values())

    def restarts(self, name: str) -> int:
        rec = self.records.get(name)
        return rec.total if rec else 0

    def failed(self, name: str, why: str) -> None:
        """Process `name` failed (`why`: "exited with code -9"): schedules its restart, or raises GiveUp."""
        now, p = self.clock(), self.policy
        rec = self.records.setdefault(name, _Record(now))
        if now - rec.started >= p.reset_after:
            rec.row = 0  # it had run long enough: this is a new failure, not the last restart's
        if rec.row >= p.max_restarts:
            limit = (
                "restarts are off (cluster.max_restarts: 0)"
                if p.max_restarts == 0
                else f"{rec.row} restart{'s' if rec.row != 1 else ''} in a row already "
                f"(cluster.max_restarts: {p.max_restarts}); giving up"
            )
            raise GiveUp(name, f"node {name} {why}; {limit}")
        delay = p.delay(rec.row)
        rec.row += 1
        rec.due, rec.ports_free_by = now + delay, now + delay + p.port_wait
        self.say(
            f"node {name} {why}; restarting it in {delay:.3g}s (restart {rec.row} of at most {p.max_restarts} in a row)"
        )

    def due(self) -> list[str]:
        """The processes whose restart is due now."""
        now = self.clock()
        return [n for n, r in self.records.items() if r.due is not None and r.due <= now]

    def ports_ready(self, name: str, ports: tuple[int, ...]) -> bool:
        """Whether `name`'s ports are free for its restart; ports still taken after `port_wait` fail the
        restart (`failed`: the next of the row, or GiveUp)."""
        taken = busy(ports)
        if not taken:
            return True
        rec = self.records[name]
        if self.clock() >= rec.ports_free_by:
            rec.due, rec.started = None, self.clock()  # an attempt that failed at once: the row goes on
            listed = ", ".join(map(str, taken))
            self.failed(name, f"could not be restarted: port(s) {listed} still in use after {self.policy.port_wait:g}s")
        return False

    def restarting(self, name: str) -> dict[str, str]:
        """Counts the restart about to happen; the environment it adds for the new process."""
        rec = self.records[name]
        rec.total += 1
        return {RESTARTS_ENV: str(rec.total)}
