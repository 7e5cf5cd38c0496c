"""The API's connections over real sockets against a real server (uvicorn with afd's protocol and Guard,
on a thread): idle, header and body deadlines, a 413 that a client sending its whole body first can read,
and a steady slow upload left alone. Deadlines are a fraction of a second here; the defaults are seconds."""

from __future__ import annotations

import http.client
import json
import select
import socket
import time

import httpx
import pytest
from http_servers import running

from afd.config.http_section import HttpSection

FAST = HttpSection(keep_alive_timeout=0.5, header_timeout=0.6, body_timeout=0.6, body_min_rate=500, max_body_bytes=1000)


@pytest.fixture(scope="module")
def port():
    with running(FAST) as p:
        yield p


def _closed_within(s: socket.socket, seconds: float) -> bool:
    s.settimeout(seconds)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def _trickle_until_answered(s: socket.socket, byte: bytes, every: float, limit: float) -> tuple[bytes, float]:
    """Sends `byte` every `every` seconds until the server answers; returns (answer, seconds taken)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        s.sendall(byte)
        if select.select([s], [], [], every)[0]:
            s.settimeout(2)
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
                chunk = s.recv(4096)
                if not chunk:
                    break
                answer += chunk
            return answer, time.monotonic() - t0
    raise AssertionError(f"no answer after {limit}s of trickling")


def test_idle_connections_are_closed_after_the_idle_timeout(port):
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(50)]
    t0 = time.monotonic()
    try:
        assert not _closed_within(socks[0], 0.3)  # not at once: a client has keep_alive_timeout to start
        assert all(_closed_within(s, 2.0) for s in socks)
        assert time.monotonic() - t0 < 2.0
    finally:
        for s in socks:
            s.close()


def test_headers_sent_a_byte_at_a_time_get_408(port):
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/echo HTTP/1.1\r\n")
        answer, took = _trickle_until_answered(s, b"x", 0.1, 5)
    assert answer.startswith(b"HTTP/1.1 408 ") and b"http.header_timeout" in answer
    assert 0.5 < took < 2.0


def test_a_trickled_body_gets_408_and_is_cut(port):
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/echo HTTP/1.1\r\nhost: t\r\ncontent-length: 500\r\n\r\n")
        answer, took = _trickle_until_answered(s, b"x", 0.1, 5)
    assert answer.startswith(b"HTTP/1.1 408 ") and b"http.body_min_rate" in answer
    assert 0.5 < took < 2.0


def test_a_slow_but_steady_body_is_not_cut():
    """1000 bytes/s (twice body_min_rate) for 1.2 s, three times body_timeout: answered in full."""
    http_ = HttpSection(keep_alive_timeout=0.5, header_timeout=0.6, body_timeout=0.4, body_min_rate=500)
    with running(http_) as p:
        conn = http.client.HTTPConnection("127.0.0.1", p, timeout=10)
        t0 = time.monotonic()

        def slowly():
            for _ in range(12):
                yield b"y" * 100  # 100 bytes each 0.1 s: 1000 bytes/s
                time.sleep(0.1)

        conn.request("POST", "/v1/echo", body=slowly(), headers={"content-length": "1200"})
        r = conn.getresponse()
        assert r.status == 200 and r.read() == b'{"bytes":1200}'
        assert time.monotonic() - t0 > 1.0  # longer than body_timeout, and not cut
        conn.close()


def test_an_oversized_body_sent_whole_gets_a_readable_413(port):
    """http.client and httpx write the whole body before they read: the server must read and drop it
    after its 413, not close with it unread (the kernel then resets the connection, and the client sees
    "connection reset" or "broken pipe" instead of the 413)."""
    body = b"z" * (36 << 20)
    for _ in range(3):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/echo", body=body)
        r = conn.getresponse()
        assert r.status == 413 and json.loads(r.read())["error"]["param"] == "body"
        assert r.getheader("connection") == "close"
        conn.close()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/echo", content=body, timeout=30)
    assert r.status_code == 413


def test_keep_alive_serves_several_requests_on_one_connection(port):
    with httpx.Client() as s:
        for n in (1, 10, 100):
            assert s.post(f"http://127.0.0.1:{port}/v1/echo", content=b"a" * n, timeout=5).json() == {"bytes": n}


def test_a_connection_idle_after_its_413_and_its_body_is_closed(port):
    """The 413 of a chunked body goes out before the body ends (no connection: close); once the client has
    sent the rest, the connection is idle and must be timed as such (uvicorn arms its timer only when a
    response completes, which here was before)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n")
        s.sendall(b"800\r\n" + b"x" * 2048 + b"\r\n")
        s.settimeout(5)
        answer = b""
        while not answer.endswith(b"}"):
            answer += s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 413 ")
        s.sendall(b"0\r\n\r\n")  # the body's end: the connection is now between requests
        assert _closed_within(s, 2.0)
