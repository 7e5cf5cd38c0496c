"""The node's side of the large-body check (attention_node/body_check.py runs in the child): a completion or chat
body over CHECK_ABOVE goes to the child piece by piece while it arrives, and is refused with the child's 400 as
soon as the child has one (the rest of the body is then dropped as it comes: attention_node/http_conn.py), or
handed on to the routes once whole.

The pieces go out through a queue and a thread of their own, so that the event loop never waits on the pipe
while the child is busy; the verdicts come back on another thread, by body id. Bodies from several clients go
side by side, so that a client that uploads slowly holds up no other.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import queue
import subprocess
import sys
import threading

from attention_node.body_check import CHECK_ABOVE, DATA, DROP, END, FRAME
from attention_node.memory import TRIM_ABOVE, trim

CHECKED_PATHS = ("/v1/completions", "/v1/chat/completions")
MAX_BATCH = 256
"""Frames written at once, at most."""
TIMEOUT_S = 30.0
"""A verdict later than this after the body's end: the child is replaced, and the body left to the node's parse."""


class Child:
    """One child process, the thread that writes its frames and the one that reads its verdicts."""

    def __init__(self, max_model_len: int, vocab_size: int):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "attention_node.body_check", str(max_model_len), str(vocab_size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.frames: queue.SimpleQueue[tuple[int, int, bytes] | None] = queue.SimpleQueue()
        self.waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.lock = threading.Lock()
        self.alive = True
        threading.Thread(target=self._write, name="afd-body-check-in", daemon=True).start()
        threading.Thread(target=self._read, name="afd-body-check-out", daemon=True).start()

    def send(self, body_id: int, kind: int, data: bytes = b"") -> None:
        self.frames.put((body_id, kind, data))

    def expect(self, body_id: int) -> asyncio.Future:
        """The body's verdict, once the child has it (None if the child is gone first)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self.lock:
            if not self.alive:
                future.set_result(None)
                return future
            self.waiting[body_id] = loop, future
        return future

    def _write(self) -> None:
        """Writes what the queue holds, as few writes as it takes: each write needs the node's GIL, which its
        engine thread holds for up to a switch interval at a time."""
        stdin = self.proc.stdin
        assert stdin is not None
        with contextlib.suppress(OSError):  # the child is gone: _read answers what waits
            while True:
                batch = [self.frames.get()]
                with contextlib.suppress(queue.Empty):
                    while batch[-1] is not None and len(batch) < MAX_BATCH:
                        batch.append(self.frames.get_nowait())
                last = batch[-1] is None
                size = sum(len(f[2]) for f in batch if f is not None)
                _write_frames(stdin.fileno(), batch)
                del batch  # not held while waiting for the next: their pages go back (memory.py)
                if size > TRIM_ABOVE and self.frames.empty():  # the node's own trim may have run before this
                    trim()
                if last:
                    break
        with contextlib.suppress(OSError):
            stdin.close()

    def _read(self) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        with contextlib.suppress(OSError, ValueError):
            for line in stdout:
                body_id, _, answer = line.partition(b" ")
                with self.lock:
                    waiter = self.waiting.pop(int(body_id), None)
                if waiter is not None:
                    _answer(waiter, json.loads(answer))
        with self.lock:
            self.alive, waiting = False, list(self.waiting.values())
            self.waiting.clear()
        for waiter in waiting:  # the child died or was killed: these bodies go to the node's own parse
            _answer(waiter, None)

    def close(self) -> None:
        self.frames.put(None)
        self.proc.kill()
        self.proc.wait(5)


def _write_frames(fd: int, frames: list[tuple[int, int, bytes] | None]) -> None:
    parts: list[bytes | memoryview] = []
    for frame in frames:
        if frame is not None:
            parts += [FRAME.pack(frame[0], frame[1], len(frame[2])), frame[2]]
    i = 0
    while i < len(parts):
        n = os.writev(fd, parts[i : i + 1024])  # IOV_MAX
        while i < len(parts) and n >= len(parts[i]):
            n -= len(parts[i])
            i += 1
        if n:
            parts[i] = memoryview(parts[i])[n:]


def _answer(waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future], value: dict | None) -> None:
    loop, future = waiter

    def settle() -> None:
        if not future.done():
            future.set_result(value)

    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
        loop.call_soon_threadsafe(settle)


class BodyChecker:
    """The child, started with the first large body and kept: a child that dies or is slow is replaced, and
    the bodies it held are left to the node's own parse."""

    def __init__(self, max_model_len: int, vocab_size: int):
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self._ids = itertools.count()
        self._child: Child | None = None
        self._lock = threading.Lock()

    def child(self) -> Child:
        with self._lock:
            if self._child is None or not self._child.alive or self._child.proc.poll() is not None:
                if self._child is not None:
                    self._child.close()
                self._child = Child(self.max_model_len, self.vocab_size)
            return self._child

    def open(self) -> Body:
        return Body(self, next(self._ids))

    async def check(self, body: bytes) -> dict | None:
        """The verdict on a whole body."""
        handle = self.open()
        handle.feed(body)
        return await handle.finish()

    def close(self) -> None:
        with self._lock:
            if self._child is not None:
                self._child.close()
                self._child = None


class Body:
    """One body on its way to the child: feed() each piece as it arrives (`verdict` may come before the end),
    then finish() for the verdict, or drop() when it is no longer wanted."""

    def __init__(self, checker: BodyChecker, body_id: int):
        self.checker, self.id = checker, body_id
        self._child: Child | None = None
        self.verdict: asyncio.Future | None = None

    def feed(self, data: bytes) -> None:
        if self._child is None:
            self._child = self.checker.child()
            self.verdict = self._child.expect(self.id)
        self._child.send(self.id, DATA, data)

    async def finish(self) -> dict | None:
        if self._child is None:
            self.feed(b"")
        assert self._child is not None and self.verdict is not None
        self._child.send(self.id, END)
        try:
            return await asyncio.wait_for(asyncio.shield(self.verdict), TIMEOUT_S)
        except asyncio.TimeoutError:
            await asyncio.to_thread(self._child.close)  # what else waits gets None; the next body starts a new child
            return None

    def refused(self) -> dict | None:
        """The child's 400, where it came before the body's end."""
        v = self.verdict
        return v.result() if v is not None and v.done() else None

    def drop(self) -> None:
        if self._child is not None:
            self._child.send(self.id, DROP)


class CheckLargeBodies:
    """ASGI middleware (inside the guard, so after its API key and size checks): a POST completion or chat body
    over CHECK_ABOVE goes to the child while it arrives, and is either refused with the child's 400 or handed on
    whole."""

    def __init__(self, app, max_model_len: int, vocab_size: int):
        self.app, self.checker = app, BodyChecker(max_model_len, vocab_size)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in CHECKED_PATHS:
            return await self.app(scope, receive, send)
        size = dict(scope["headers"]).get(b"content-length", b"")
        if size.isdigit() and int(size) <= CHECK_ABOVE:
            return await self.app(scope, receive, send)
        from fastapi import HTTPException
        from fastapi.responses import JSONResponse

        checked = self.checker.open()
        chunks: list[bytes] = []
        fed = held = 0  # chunks given to the child (none until the body is past CHECK_ABOVE), bytes received
        more, error = True, None
        try:
            while more:
                try:
                    message = await self._next(receive, checked)
                except HTTPException as e:  # the guard's 413 for a chunked body past the limit
                    err = {"error": {"message": str(e.detail), "type": "BadRequestError", "param": "body", "code": 413}}
                    return await JSONResponse(err, status_code=e.status_code)(scope, receive, send)
                if message is None:  # the child's 400 came first: the rest of the body is dropped as it arrives
                    error = checked.refused()
                    break
                if message["type"] != "http.request":
                    return  # the client went away
                chunks.append(message.get("body", b""))
                held += len(chunks[-1])
                more = message.get("more_body", False)
                if held > CHECK_ABOVE:
                    for chunk in chunks[fed:]:
                        checked.feed(chunk)
                    fed = len(chunks)
            if error is None and held > CHECK_ABOVE:
                error = await checked.finish()
        finally:
            if more:
                checked.drop()
        if error is not None:
            headers = {"connection": "close"} if more else None
            return await JSONResponse(error, status_code=400, headers=headers)(scope, receive, send)
        body = b"".join(chunks)
        del chunks
        replayed = False

        async def replay():
            nonlocal replayed, body
            if replayed:
                return await receive()  # a disconnect, for the routes that watch for one
            replayed, whole, body = True, body, b""
            return {"type": "http.request", "body": whole, "more_body": False}

        await self.app(scope, replay, send)

    @staticmethod
    async def _next(receive, checked: Body) -> dict | None:
        """The next ASGI message, or None if the child refuses the body first."""
        if checked.verdict is None or checked.verdict.done():  # not yet fed, or the child already spoke
            return None if checked.refused() is not None else await receive()
        receiving = asyncio.ensure_future(receive())
        await asyncio.wait((receiving, checked.verdict), return_when=asyncio.FIRST_COMPLETED)
        if checked.refused() is not None:
            receiving.cancel()
            return None
        return await receiving
