"""The header phase is bounded: over real loopback sockets, a client that dribbles its
headers is answered 408 and closed, idle connections are closed, an endless head is
answered 431, and a normal keep-alive client (or a slow body) is unaffected."""

from __future__ import annotations

import contextlib
import json
import select
import selectors
import socket
import time
from typing import Any

import orjson

from tests.live import LiveServer
from tests.unit.conftest import MakeApp

# Small, so that the tests wait little; the default is limits.HEADER_READ_TIMEOUT_S.
TIMEOUT_S = 0.5
# Generous upper bounds on a loaded 2-core machine.
SLACK_S = 5.0
# How much earlier than the limit the test may see the cut: the server's clock starts when
# it takes the connection, the test's when `connect` returns, and the event loop may run a
# timer up to a clock tick early. Far below the limit, so a cut at half of it still fails.
EARLY_S = 0.02
BODY = orjson.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]})


def _serve(make_app: MakeApp, live: Any) -> LiveServer:
    server: LiveServer = live(make_app().app, header_read_timeout_s=TIMEOUT_S)
    return server


def _connect(server: LiveServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=SLACK_S)


def _read_until_closed(sock: socket.socket, limit_s: float) -> bytes:
    """Everything the server sends until it closes the connection (within `limit_s`)."""
    sock.settimeout(limit_s)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def _response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One whole response (Content-Length framed) read from a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed mid-response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the connection closed mid-body"
        body += chunk
    return int(status_line.split()[1]), headers, body


def _error(response: bytes) -> tuple[int, str]:
    head, _, body = response.partition(b"\r\n\r\n")
    assert b"\r\nconnection: close" in head.lower(), head
    return int(head.split()[1]), json.loads(body)["error"]["message"]


def test_a_client_dribbling_its_headers_gets_408_and_is_closed(
    make_app: MakeApp, live: Any
) -> None:
    server = _serve(make_app, live)
    with _connect(server) as sock:
        start = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        sock.settimeout(0.05)
        received = b""
        while not received and time.monotonic() - start < SLACK_S:
            sock.sendall(b"a")  # one byte of header every 50 ms: never complete
            try:
                received = sock.recv(65536)
            except TimeoutError:
                continue
        cut_after = time.monotonic() - start
        received += _read_until_closed(sock, SLACK_S)
    status, message = _error(received)
    assert status == 408 and f"did not arrive within {TIMEOUT_S:g} s" in message
    assert TIMEOUT_S - EARLY_S <= cut_after < TIMEOUT_S + SLACK_S


def test_a_hundred_idle_connections_are_all_closed_after_the_limit(
    make_app: MakeApp, live: Any
) -> None:
    server = _serve(make_app, live)
    start = time.monotonic()
    socks = [_connect(server) for _ in range(100)]
    selector = selectors.DefaultSelector()
    for sock in socks:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    closed_at: dict[socket.socket, float] = {}
    sent: list[bytes] = []
    while len(closed_at) < len(socks) and time.monotonic() - start < TIMEOUT_S + SLACK_S:
        for key, _ in selector.select(timeout=0.1):
            ready = key.fileobj
            assert isinstance(ready, socket.socket)
            chunk = ready.recv(65536)
            if chunk:
                sent.append(chunk)
                continue
            closed_at[ready] = time.monotonic() - start
            selector.unregister(ready)
    for sock in socks:
        sock.close()
    assert len(closed_at) == 100, f"{100 - len(closed_at)} idle connections still open"
    assert min(closed_at.values()) >= TIMEOUT_S  # not before the limit
    assert sent == []  # an idle connection is closed silently, as keep-alive would
    # The server itself is unaffected.
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _response(sock)[0] == 200


def test_a_keep_alive_client_and_a_slow_body_are_unaffected(make_app: MakeApp, live: Any) -> None:
    timeout_s = 1.0  # the client's pauses are a fifth of it: room for a loaded machine
    server: LiveServer = live(make_app().app, header_read_timeout_s=timeout_s)
    head = (
        "POST /rollouts/r/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
    ).encode()
    with _connect(server) as sock:
        start = time.monotonic()
        # Requests spread over more than the limit, on one connection: the deadline
        # starts again after each response.
        for _ in range(6):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            status, headers, _ = _response(sock)
            assert status == 200 and headers.get("connection") != "close"
            time.sleep(timeout_s / 5)
        assert time.monotonic() - start > timeout_s
        # A body that takes longer than the header limit: the headers were complete, so
        # only the body's own (60 s) limit applies.
        sock.sendall(head + BODY[:10])
        time.sleep(timeout_s * 1.5)
        sock.sendall(BODY[10:])
        status, _, body = _response(sock)
        assert status == 200, body
        assert json.loads(body)["choices"][0]["message"]["content"]
        # Then the connection idles, and is closed once the limit passes.
        idle_from = time.monotonic()
        assert _read_until_closed(sock, SLACK_S) == b""
        assert time.monotonic() - idle_from >= timeout_s * 0.9


def _send_until_answered(sock: socket.socket, first: bytes, piece: bytes, most: int) -> bytes:
    """Send `first`, then `piece` after `piece` (up to `most` bytes), until the server answers
    or closes; then everything it sent."""
    sent = 0
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        sock.sendall(first)
        while sent < most and not select.select([sock], [], [], 0.02)[0]:
            sock.sendall(piece)
            sent += len(piece)
    return _read_until_closed(sock, SLACK_S)


def test_a_head_that_never_ends_gets_431_before_it_is_buffered(
    make_app: MakeApp, live: Any
) -> None:
    server = _serve(make_app, live)
    most = 4 * 1024 * 1024  # the bound is 128 KiB (plus at most one read)
    with _connect(server) as sock:
        head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
        answer = _send_until_answered(sock, head, b"a" * 16384, most)
    status, message = _error(answer)
    assert status == 431 and "exceed 131072 bytes" in message
    with _connect(server) as sock:
        answer = _send_until_answered(sock, b"GET /health HTTP/1.1\r\n", b"x: 1\r\n" * 2000, most)
    assert _error(answer)[0] == 431
    # A body is no head: a large one on a kept-alive connection, answered early (413) while
    # it still arrives, costs the next request nothing.
    with _connect(server) as sock:
        body = b"x" * (40 * 1024 * 1024)
        sock.sendall(
            b"POST /rollouts/r/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        )
        sock.sendall(body[: 1024 * 1024])
        assert _response(sock)[0] == 413
        sock.sendall(body[1024 * 1024 :])
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _response(sock)[0] == 200
