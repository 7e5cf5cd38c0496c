"""OpenAI streaming completions read event by event, as the failover benchmark, the tests and the device
check read them: one (`stream_completion`), one with each event's arrival time (`stream_timed`), and many at
once (`Streams`)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator


def stream_completion(
    url: str, body: dict, timeout: float, headers: dict | None = None
) -> Iterator[tuple[list[int], str | None]]:
    """POSTs `body` (streamed, with token ids) to `url`/v1/completions, with `headers` besides the content type
    (an API key's); yields each event's token ids and its error message (None when it has none). A failed
    connection or read raises."""
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps({**body, "stream": True, "return_token_ids": True}).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            ev = json.loads(line[len(b"data: ") :])
            error = ev["error"]["message"] if "error" in ev else None
            yield [t for c in ev.get("choices", []) for t in (c.get("token_ids") or [])], error


def stream_timed(url: str, body: dict, timeout: float, headers: dict | None = None) -> dict:
    """One streaming completion, never raising: its token ids, error messages, and the monotonic times of
    its start, of each event that carried tokens, and of its end."""
    rec: dict = {"ids": [], "errors": [], "times": [], "start": time.monotonic()}
    try:
        for got, error in stream_completion(url, body, timeout, headers):
            if error is not None:
                rec["errors"].append(error)
            if got:
                rec["ids"].extend(got)
                rec["times"].append(time.monotonic())
    except Exception as e:  # noqa: BLE001 (a dead node's connection: reported through the record)
        rec["errors"].append(f"{type(e).__name__}: {e}")
    rec["end"] = time.monotonic()
    return rec


class Streams:
    """Concurrent streaming completions, one per prompt, each read by stream_completion with `read_timeout`;
    results[i] is (token ids, error messages) once stream i has ended."""

    def __init__(self, url: str, prompts: list[list[int]], body: dict, read_timeout: float):
        self.results: list = [None] * len(prompts)
        self.times: list[list[float]] = [[] for _ in prompts]
        """When each stream's chunks that carried tokens arrived (time.monotonic)."""
        self._first = threading.Semaphore(0)
        self.threads = [
            threading.Thread(target=self._run, args=(i, url, {**body, "prompt": p}, read_timeout), daemon=True)
            for i, p in enumerate(prompts)
        ]
        for t in self.threads:
            t.start()

    def _run(self, i: int, url: str, body: dict, read_timeout: float) -> None:
        ids, errors, first = [], [], True
        try:
            for got, error in stream_completion(url, body, read_timeout):
                if error is not None:
                    errors.append(error)
                ids.extend(got)
                if got:
                    self.times[i].append(time.monotonic())
                if first:
                    first = False
                    self._first.release()
        except Exception as e:  # noqa: BLE001 (reported through the result)
            errors.append(repr(e))
        finally:
            if first:
                self._first.release()
        self.results[i] = (ids, errors)

    def wait_started(self, timeout: float) -> bool:
        """True once every stream has its first chunk (or ended), within `timeout` in all."""
        end = time.monotonic() + timeout
        return all(self._first.acquire(timeout=max(0.0, end - time.monotonic())) for _ in self.threads)

    def largest_gap(self, since: float = 0.0) -> float:
        """The longest wait between two token-carrying chunks of one stream, the second after `since`: how
        long the node stopped streaming."""
        return max(
            (b - a for ts in self.times for a, b in zip(ts, ts[1:]) if b > since),
            default=0.0,
        )

    def finished(self) -> int:
        return sum(r is not None for r in self.results)

    def join(self, timeout: float) -> int:
        """Waits up to `timeout` in all; returns how many streams are still open (hung)."""
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))
        return sum(t.is_alive() for t in self.threads)


class Ticker:
    """Greedy streams from one attention node, one after another, with the arrival time of every chunk
    that carries tokens: the longest gap between two is how long the node stalled."""

    def __init__(self, url: str, prompts: list[list[int]], new_tokens: int):
        self.url, self.prompts, self.new, self.stop = url, prompts, new_tokens, threading.Event()
        self.chunks: list[float] = []
        self.done: list[tuple[list[int], list[int]]] = []
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)  # a failed test never waits on it
        self.thread.start()

    def _run(self) -> None:
        i = 0
        while not self.stop.is_set():
            prompt = self.prompts[i % len(self.prompts)]
            i += 1
            body = {"prompt": prompt, "max_tokens": self.new, "temperature": 0}
            ids: list[int] = []
            try:
                for got, error in stream_completion(self.url, body, 120):
                    if error is not None:
                        self.errors.append(error)
                    if got:
                        self.chunks.append(time.monotonic())
                        ids.extend(got)
            except Exception as e:  # noqa: BLE001 (reported through errors)
                self.errors.append(repr(e))
                return
            self.done.append((prompt, ids))

    def gaps(self, start: float, end: float) -> list[float]:
        """Gaps between consecutive chunks that end within [start, end]."""
        t = self.chunks
        return [b - a for a, b in zip(t, t[1:]) if start <= b <= end]

    def join(self) -> None:
        self.stop.set()
        self.thread.join(150)
