"""The task graph afd.plan.simulate builds for one decode step, and its schedule.

Tasks run on resources that each run one task at a time, in the order they were added (an attention rank's
compute, an FFN node's, one direction of a link, a process's transport thread); a task starts once its
resource's previous task and every task it waits for (`after`) have ended.

Without host cores that is the whole schedule, one pass in the order the tasks were added. With `cores`
(CostModel.host_cores: node processes sharing one host's CPU) compute tasks also need a core, and the
cores are shared as the kernel's scheduler time-slices its runnable threads: n compute tasks running at once
on c < n cores each progress at c/n of their speed (processor sharing). A task that shares is not idle:
`queued` counts the time it ran longer than its duration for want of a core.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

END_SLACK = 1e-12
"""Seconds of work left below which a task counts as done (the fluid schedule's rounding)."""


class Timeline:
    def __init__(self, cores: int = 0):
        self.cores = cores
        self.tasks: list[tuple[object, tuple[int, ...], float, bool]] = []
        """(resource, the tasks it waits for, duration, needs a core), in the order added."""
        self.start: list[float] = []
        self.end: list[float] = []
        self.busy: dict = defaultdict(float)
        """Per resource, the durations of its tasks."""
        self.idle: dict = defaultdict(float)
        """Per resource, time it stood waiting for a task's inputs with nothing else to do."""
        self.queued: dict = defaultdict(float)
        """Per resource, time its tasks ran beyond their durations, sharing a core."""

    def run(self, resource, after: Iterable[int], duration: float, core: bool = False) -> int:
        """Adds a task of `duration` on `resource` that starts once the tasks `after` have ended; returns its id.
        Times are known once `solve` has run."""
        self.tasks.append((resource, tuple(after), duration, core))
        return len(self.tasks) - 1

    def solve(self) -> Timeline:
        n = len(self.tasks)
        self.start, self.end = [0.0] * n, [0.0] * n
        if self.cores and any(core and d > 0 for _, _, d, core in self.tasks):
            self._shared()
        else:
            self._alone()
        free: dict = defaultdict(float)
        for k, (res, _, d, _) in enumerate(self.tasks):
            self.idle[res] += self.start[k] - free[res]
            self.queued[res] += self.end[k] - self.start[k] - d
            self.busy[res] += d
            free[res] = self.end[k]
        return self

    @property
    def finish(self) -> float:
        return max(self.end, default=0.0)

    def _alone(self) -> None:
        """Every task at full speed: start = max(the resource free, its inputs in), in the order added."""
        free: dict = defaultdict(float)
        for k, (res, after, d, _) in enumerate(self.tasks):
            start = max([free[res], *(self.end[j] for j in after)])
            self.start[k], self.end[k] = start, start + d
            free[res] = start + d

    def _shared(self) -> None:
        """Time advances from one task's end to the next; in between every running task progresses at its
        rate (1, or cores / running compute tasks for a compute task when they outnumber the cores). A task
        runs once it heads its resource's queue and its inputs have ended: it never waits for a core."""
        queues: dict = defaultdict(list)
        for k, (res, _, _, _) in enumerate(self.tasks):
            queues[res].append(k)
        head = dict.fromkeys(queues, 0)
        left = [d for _, _, d, _ in self.tasks]
        done = [False] * len(self.tasks)
        running: dict = {}  # resource -> its running task
        now = 0.0

        def admit() -> None:
            for res, q in queues.items():
                if res in running or head[res] == len(q):
                    continue
                k = q[head[res]]
                if all(done[j] for j in self.tasks[k][1]):
                    running[res] = k
                    self.start[k] = now

        while True:
            admit()
            while zero := [r for r, k in running.items() if left[k] <= END_SLACK]:
                for r in zero:
                    self._done(running.pop(r), now, done, head)
                admit()
            if not running:
                break
            computing = sum(1 for k in running.values() if self.tasks[k][3])
            share = min(1.0, self.cores / computing) if computing else 1.0
            rate = {r: share if self.tasks[k][3] else 1.0 for r, k in running.items()}
            dt = min(left[k] / rate[r] for r, k in running.items())
            now += dt
            for r, k in running.items():
                left[k] -= rate[r] * dt
        if not all(done):
            raise RuntimeError("the step's task graph waits on itself: a task's input comes after it")

    def _done(self, k: int, now: float, done: list[bool], head: dict) -> None:
        self.end[k], done[k] = now, True
        head[self.tasks[k][0]] += 1
