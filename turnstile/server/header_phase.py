"""uvicorn's HTTP protocol with a bounded header phase: slow or silent clients are cut off.

uvicorn hands the app nothing until a request's headers are complete, and bounds neither
how long they may take nor how many bytes they may fill: a client that opens connections
and sends nothing, or dribbles its headers a byte at a time (slowloris), holds them open
for ever, and one that streams an endless header line grows a buffer without end. The
app's own limits (the body read timeout, `HeaderLimits`' 431) only start once the headers
are in.

`bounded_http_protocol(timeout_s)` is the protocol class `turnstile serve` (and every
worker) passes to uvicorn: from the moment a connection opens, and again after each
response, the next request's head (request line and headers) must be complete within
`timeout_s` and `max_head_bytes`. Past the deadline the connection is answered 408 if part
of a request has arrived (closed silently if nothing has), and past the byte bound it is
answered 431; either way it is then closed. Requests in progress are not affected: the
deadline stops once a request's headers are complete.
"""

from __future__ import annotations

import asyncio
import http

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from turnstile.errors import HeadersTooLarge, RequestTimeout, TurnstileError
from turnstile.limits import HEADER_READ_TIMEOUT_S, MAX_REQUEST_HEAD_BYTES


class BoundedHeaderProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with a deadline and a byte bound on each request head."""

    header_timeout_s: float = HEADER_READ_TIMEOUT_S
    max_head_bytes: int = MAX_REQUEST_HEAD_BYTES

    _deadline: asyncio.TimerHandle | None = None
    _awaiting_head = False  # the deadline runs: no request's headers are complete
    _received = False  # bytes arrived since the deadline started
    _in_head = False  # the parser is inside a request's line and headers
    _head_bytes = 0  # bytes received while it was

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._received = True
        # Counted from the chunk after the one a request began in: every byte of it up to
        # the end of the headers belongs to them (the bound is exceeded by less than one
        # read, and the tail of an earlier request's body is never counted).
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.max_head_bytes:
            self._refuse(
                HeadersTooLarge(f"the request line and headers exceed {self.max_head_bytes} bytes")
            )

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._awaiting_head = False
        self._stop_deadline()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        # A pipelined request already parsed starts now; its head is complete.
        next_is_parsed = bool(self.pipeline)
        super().on_response_complete()
        if not next_is_parsed and not self.transport.is_closing():
            self._await_head()

    def _await_head(self) -> None:
        self._stop_deadline()
        self._awaiting_head = True
        self._received = False
        self._deadline = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _stop_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_timed_out(self) -> None:
        self._deadline = None
        if not self._awaiting_head or self.transport.is_closing():
            return
        if not self._received:
            # Nothing of a request arrived: an idle connection, closed as keep-alive would.
            self._awaiting_head = False
            self.transport.close()
            return
        self._refuse(
            RequestTimeout(f"the request headers did not arrive within {self.header_timeout_s:g} s")
        )

    def _refuse(self, exc: TurnstileError) -> None:
        """Answer `exc` (OpenAI-style JSON, `Connection: close`) and close the connection."""
        self._awaiting_head = self._in_head = False
        self._stop_deadline()
        if self.transport.is_closing():
            return
        body = exc.body_bytes()
        head = [f"HTTP/1.1 {exc.status} {http.HTTPStatus(exc.status).phrase}\r\n".encode()]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: " + str(len(body)).encode() + b"\r\n",
            b"connection: close\r\n\r\n",
            body,
        ]
        self.transport.write(b"".join(head))
        self.transport.close()


def bounded_http_protocol(
    timeout_s: float = HEADER_READ_TIMEOUT_S, max_head_bytes: int = MAX_REQUEST_HEAD_BYTES
) -> type[BoundedHeaderProtocol]:
    """The protocol class to pass to `uvicorn.Config(http=...)`: each request's head must
    arrive within `timeout_s` and `max_head_bytes`."""

    class Bounded(BoundedHeaderProtocol):
        pass

    Bounded.header_timeout_s = timeout_s
    Bounded.max_head_bytes = max_head_bytes
    return Bounded
