"""How a local cluster hands its offline attention nodes jobs, one after another, and gets their results.

A mailbox is a private directory per attention node: the launcher writes `job-N.json` (N = 0, 1, ...)
and, to end the node's work, `stop`; the node's rank 0 takes job N when it is there, runs it, and writes
`result-N.json`. Every file is written whole under a temporary name and renamed into place, so a reader
never sees half of one. Files rather than the node's stdin: its output is its log, and a job of many
prompts is one file either way.

`afd-attention generate --prompts-file F` with a plain file is the one-job form (`OneJob`): F is job 0,
its result goes to `--output-file`, and then the node stops.
"""

from __future__ import annotations

import json
import os

STOP = "stop"
"""What `take` returns once the launcher has said stop and no job is left."""


def _write(path: str, doc) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh)
    os.replace(tmp, path)


class JobMailbox:
    def __init__(self, path: str):
        self.path = path
        os.makedirs(path, exist_ok=True)

    def _file(self, kind: str, n: int) -> str:
        return os.path.join(self.path, f"{kind}-{n}.json")

    # ---- the launcher's side ----------------------------------------------------------------------

    def submit(self, n: int, job: dict) -> None:
        _write(self._file("job", n), job)

    def stop(self) -> None:
        _write(os.path.join(self.path, STOP), {})

    def result(self, n: int) -> dict | None:
        """Job n's result once the node has written it."""
        try:
            with open(self._file("result", n)) as fh:
                return json.load(fh)
        except FileNotFoundError:
            return None

    # ---- the node's side --------------------------------------------------------------------------

    def first_open(self) -> int:
        """The first job without a result: where a restarted node picks up (the jobs before it are done)."""
        n = 0
        while os.path.exists(self._file("result", n)):
            n += 1
        return n

    def take(self, n: int) -> dict | str | None:
        """Job n, STOP, or None while there is neither yet. A mailbox that is gone is a STOP: the
        launcher removed it with its temporary directory."""
        try:
            with open(self._file("job", n)) as fh:
                return json.load(fh)
        except FileNotFoundError:
            gone = not os.path.isdir(self.path) or os.path.exists(os.path.join(self.path, STOP))
            return STOP if gone else None

    def put_result(self, n: int, result: dict) -> None:
        _write(self._file("result", n), result)


class OneJob:
    """A prompts file as a mailbox that holds job 0 and then STOP; job 0's result goes to `output`."""

    def __init__(self, prompts_file: str, output: str | None):
        self.prompts_file, self.output = prompts_file, output

    def first_open(self) -> int:
        return 0

    def take(self, n: int) -> dict | str | None:
        if n > 0:
            return STOP
        with open(self.prompts_file) as fh:
            return json.load(fh)

    def put_result(self, n: int, result: dict) -> None:
        if self.output is not None:
            with open(self.output, "w") as fh:
                json.dump(result, fh)


def jobs_of(prompts_file: str, output: str | None) -> JobMailbox | OneJob:
    """`--prompts-file` names a mailbox directory (a local cluster's node) or one job's file."""
    return JobMailbox(prompts_file) if os.path.isdir(prompts_file) else OneJob(prompts_file, output)
