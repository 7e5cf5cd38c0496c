"""uvicorn's h11 protocol with the read deadlines uvicorn lacks, and a lingering close.

uvicorn times a connection out only between requests (timeout_keep_alive, armed once a response is done): a
connection that never sends a byte, or sends its headers or body a byte at a time, would hold its slot for
as long as the client likes. Here every phase has a deadline (`HttpSection`): idle (nothing sent yet),
headers, body (kept alive by progress at body_min_rate). Past it the connection closes, with a 408 where an
answer can still be given.

Closing while the client is still sending makes the kernel answer its next bytes with a reset, and a client
that writes its whole body before reading (requests, curl) then sees "connection reset" instead of the 413
or 408 it was sent. So a close with request bytes still to come lingers: the response is out, what arrives
is read and dropped, and the socket closes when the client closes, or after LINGER_SECONDS or LINGER_BYTES.
"""

from __future__ import annotations

import contextlib
import json
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from afd.config.http_section import HttpSection
from attention_node.openai_protocol import ApiError

LINGER_SECONDS = 5.0
LINGER_BYTES = 256 << 20
LINGER_READ = 4 << 20
"""Bytes read at once while lingering: each read waits for the GIL, which the engine thread holds for up to a switch
interval at a time."""


def protocol_class(limits: HttpSection) -> type:
    """The protocol class for uvicorn.Config(http=...) with `limits`' deadlines."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


class _Transport:
    """The connection's transport as uvicorn sees it: its close() lingers while the client is still sending."""

    def __init__(self, transport, protocol: GuardedH11Protocol):
        self._t, self._p = transport, protocol

    def close(self) -> None:
        self._p.close_gently()

    def is_closing(self) -> bool:
        return self._p.lingering or self._t.is_closing()

    def __getattr__(self, name):
        return getattr(self._t, name)


class GuardedH11Protocol(H11Protocol):
    limits: HttpSection = HttpSection()

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.lingering, self._raw = False, None
        self._timer, self._phase, self._deadline = None, "", 0.0
        self._lingered = 0

    # ---- deadlines ----

    def connection_made(self, transport) -> None:
        self._raw = transport
        super().connection_made(_Transport(transport, self))  # type: ignore[arg-type]
        self._follow(0)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            self._lingered += len(data)
            if self._lingered > LINGER_BYTES:
                self._close_now()
            return
        super().data_received(data)
        self._follow(len(data))

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next request from bytes already buffered
        self._follow(0)

    def _follow(self, received: int) -> None:
        """The phase (and its deadline) the connection is in now, from h11's view of the client. Idle is
        timed here too, not only by uvicorn's keep-alive timer: uvicorn arms that only when a response
        completes, so a connection that finished sending a body after its answer (a 413 on a chunked body)
        would have no deadline at all."""
        if self._raw is None or self._raw.is_closing() or self.lingering:
            return
        state, lim = self.conn.their_state, self.limits
        if state is h11.SEND_BODY:
            if self._phase != "body":
                self._enter("body", lim.body_timeout)
            else:  # progress: a second more per body_min_rate bytes, never beyond body_timeout from now
                cap = time.monotonic() + lim.body_timeout
                self._deadline = min(self._deadline + received / lim.body_min_rate, cap)
        elif state is h11.IDLE and self.conn.trailing_data[0]:  # part of a request's head
            if self._phase != "header":
                self._enter("header", lim.header_timeout)
        elif state is h11.IDLE:  # between requests (their_state is IDLE only once both sides are done)
            if self._phase != "idle":
                self._enter("idle", lim.keep_alive_timeout)
        else:  # the request is in (or the connection is done): the app's time is not the client's
            self._enter("", None)

    def _enter(self, phase: str, timeout: float | None) -> None:
        self._phase = phase
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if timeout is not None:
            self._deadline = time.monotonic() + timeout
            self._timer = self.loop.call_at(self.loop.time() + timeout, self._check)

    def _check(self) -> None:
        """The phase's deadline, as it stands now (body progress moves it)."""
        self._timer = None
        left = self._deadline - time.monotonic()
        if self._phase == "body" and self.flow.read_paused:  # uvicorn stopped reading, not the client sending
            left = max(left, self.limits.body_timeout)
            self._deadline = time.monotonic() + left
        if left > 0:
            self._timer = self.loop.call_at(self.loop.time() + left, self._check)
            return
        phase, self._phase = self._phase, ""
        if phase == "idle":
            self.close_gently()
        elif phase == "header":
            took = f"the request's headers took over {self.limits.header_timeout:g}s (http.header_timeout)"
            raw = self._raw
            assert raw is not None  # set by connection_made(): _follow enters no phase before
            raw.write(_raw_408(took))
            self.close_gently()
        elif phase == "body":
            self._body_timed_out()

    def _body_timed_out(self) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and self.conn.our_state is h11.SEND_RESPONSE:
            raw = self._raw
            assert raw is not None  # set by connection_made(): _follow enters no phase before
            lim = self.limits
            body = _error_body(
                f"the request body came too slowly (http.body_timeout {lim.body_timeout:g}s, "
                f"http.body_min_rate {lim.body_min_rate} bytes/s)"
            )
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            headers.append((b"content-length", str(len(body)).encode()))
            for event in (h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"), h11.Data(body)):
                raw.write(self.conn.send(event))
            raw.write(self.conn.send(h11.EndOfMessage()))
        if cycle is not None:  # the app's receive() sees a disconnect; what it sends is dropped
            cycle.disconnected = True
            cycle.message_event.set()
        self.close_gently()

    # ---- closing ----

    def close_gently(self) -> None:
        """Closes the connection: at once when the client has nothing more to send, else after lingering."""
        raw = self._raw
        if raw is None or raw.is_closing() or self.lingering:
            return
        still_sending = self.conn.their_state is h11.SEND_BODY or (
            self.conn.their_state is h11.IDLE and bool(self.conn.trailing_data[0])
        )
        if not still_sending:
            self._close_now()
            return
        self.lingering = True
        self._enter("", None)
        self._timer = self.loop.call_later(LINGER_SECONDS, self._close_now)
        with contextlib.suppress(AttributeError):  # asyncio's socket transport: fewer, larger reads to drop
            raw.max_size = LINGER_READ
        raw.resume_reading()
        if raw.can_write_eof():  # our side is done: the client reads the answer to its end, then closes
            raw.write_eof()

    def _close_now(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._raw is not None and not self._raw.is_closing():
            self._raw.close()

    def eof_received(self):
        if self.lingering:
            self._close_now()
        return super().eof_received()

    def connection_lost(self, exc) -> None:
        self.lingering = False  # the transport is gone: closing it again is a plain close
        self._enter("", None)
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self.lingering:
            self._close_now()
        else:
            super().shutdown()

    def timeout_keep_alive_handler(self) -> None:
        if not self.lingering:
            super().timeout_keep_alive_handler()


def _error_body(message: str) -> bytes:
    """A 408 in the API's error shape."""
    return json.dumps(ApiError(408, message, None, "RequestTimeoutError").body()).encode()


def _raw_408(message: str) -> bytes:
    """A 408 written past h11, which has no request to answer yet."""
    body = _error_body(message)
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body
