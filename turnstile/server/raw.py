"""The `raw` serving layer: an asyncio protocol on httptools' parser, without uvicorn.

`server: raw` (`turnstile serve --server raw`) serves the same ASGI app as uvicorn does,
every route and middleware included, from a smaller HTTP/1.1 implementation: one
`asyncio.Protocol` per connection parses requests with httptools, calls the app with a
plain ASGI scope and writes what it sends straight to the transport (Content-Length
bodies as they are, others chunked). Nothing sits between the parser and the app: no
per-request config lookups, no access-log checks, no header validation regexes on the
app's own headers.

It keeps the behaviour `turnstile.server.header_phase` gives uvicorn: each request's head
must be complete within `header_timeout_s` and `max_head_bytes` (408 or 431, then
closed; an idle connection is closed silently), requests in progress are not affected.
Bodies reach the app as they arrive, so the app's 413, 408 and 503 body bounds hold as
they do under uvicorn; reading pauses while more than `READ_HIGH_WATER` bytes wait.
The rest of a body answered early (413) is read and dropped, and the connection goes on.
Pipelined requests are answered in order. `RawServer` runs the app's lifespan, listens
on a host and port or on given sockets (on uvloop where it is installed, as uvicorn
does), and on the first SIGTERM/SIGINT drains like `GracefulServer` (the proxy refuses
new calls; those in flight get the drain timeout) before it closes its listeners and
runs the shutdown that publishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import http
import logging
import signal
import socket
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Final

import httptools
from starlette.types import ASGIApp, Message

from turnstile.errors import BadRequest, HeadersTooLarge, RequestTimeout, TurnstileError
from turnstile.limits import HEADER_READ_TIMEOUT_S, MAX_REQUEST_HEAD_BYTES

if TYPE_CHECKING:
    from turnstile.proxy.core import Proxy

log = logging.getLogger("turnstile.raw")

# Request body bytes waiting for the app before the connection stops reading (as
# uvicorn's flow control): a client cannot fill memory faster than the app reads.
READ_HIGH_WATER: Final[int] = 65536
# Pending connections per listening socket, as uvicorn's default (bursts of rollouts).
LISTEN_BACKLOG: Final[int] = 2048
# After the drain, connections still answering get this long before they are cut.
CLOSE_TIMEOUT_S: Final[float] = 5.0
# How often the shutdown looks whether the last connections have closed.
_CLOSE_POLL_S: Final[float] = 0.01

_ASGI: Final[dict[str, str]] = {"version": "3.0", "spec_version": "2.3"}
_STATUS_LINES: Final[dict[int, bytes]] = {
    s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in http.HTTPStatus
}
_NO_BODY_STATUSES: Final[frozenset[int]] = frozenset({204, 304})
_INTERNAL_ERROR: Final[bytes] = (
    b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 21\r\nconnection: close\r\n\r\nInternal Server Error"
)


class _Date:
    """The Date header, formatted once a second."""

    second = -1
    header = b""

    @classmethod
    def get(cls) -> bytes:
        now = int(time.time())
        if now != cls.second:
            cls.second = now
            cls.header = b"date: " + email.utils.formatdate(now, usegmt=True).encode() + b"\r\n"
        return cls.header


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else f"HTTP/1.1 {status} \r\n".encode()


class _Cycle:
    """One request and its response: the ASGI `receive` and `send` of one app call."""

    __slots__ = (
        "body",
        "chunked",
        "conn",
        "continue_expected",
        "disconnected",
        "head",
        "keep_alive",
        "message_complete",
        "message_event",
        "remaining",
        "response_complete",
        "response_started",
        "scope",
    )

    def __init__(
        self, conn: RawHTTPProtocol, scope: dict[str, Any], keep_alive: bool, expect: bool
    ) -> None:
        self.conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.continue_expected = expect
        self.body = bytearray()
        self.message_complete = False
        self.message_event = asyncio.Event()
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self.chunked = False
        self.remaining = 0  # Content-Length bytes still to send
        self.head = b""  # the status line and headers, written with the first body part

    async def receive(self) -> Message:
        conn = self.conn
        if self.continue_expected and not conn.transport.is_closing():
            conn.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.continue_expected = False
        if not self.disconnected and not self.response_complete:
            conn.resume_reading()
            await self.message_event.wait()
            self.message_event.clear()
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        body = bytes(self.body)
        self.body.clear()
        return {"type": "http.request", "body": body, "more_body": not self.message_complete}

    async def send(self, message: Message) -> None:
        conn = self.conn
        if conn.write_paused is not None and not self.disconnected:
            await conn.write_paused.wait()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"expected 'http.response.start', got {kind!r}")
            self._start(message)
        elif not self.response_complete:
            if kind != "http.response.body":
                raise RuntimeError(f"expected 'http.response.body', got {kind!r}")
            self._body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"{kind!r} sent after the response was complete")

    def _start(self, message: Message) -> None:
        self.response_started = True
        self.continue_expected = False
        status: int = message["status"]
        content = [status_line(status), _Date.get()]
        length: int | None = None
        close_sent = False
        for name, value in message.get("headers", ()):
            lowered = name.lower()
            if lowered == b"content-length" and length is None:
                length = int(value)
            elif lowered == b"transfer-encoding" and value.lower() == b"chunked":
                self.chunked = True
            elif lowered == b"connection" and b"close" in value.lower():
                self.keep_alive = False
                close_sent = True
            content += [lowered, b": ", value, b"\r\n"]
        if not self.keep_alive and not close_sent:
            content.append(b"connection: close\r\n")
        head_only = self.scope["method"] == "HEAD" or status in _NO_BODY_STATUSES
        if length is not None and not self.chunked:
            self.remaining = 0 if head_only else length
        elif not self.chunked and not head_only:
            self.chunked = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        self.head = b"".join(content)

    def _body(self, body: bytes, more_body: bool) -> None:
        if self.scope["method"] == "HEAD":
            out = b""
        elif self.chunked:
            out = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
            if not more_body:
                out += b"0\r\n\r\n"
        else:
            if len(body) > self.remaining:
                raise RuntimeError("response content longer than Content-Length")
            self.remaining -= len(body)
            out = body
        transport = self.conn.transport
        if self.head:
            transport.write(self.head + out if out else self.head)
            self.head = b""
        elif out:
            transport.write(out)
        if not more_body:
            if self.remaining:
                raise RuntimeError("response content shorter than Content-Length")
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                transport.close()


class RawHTTPProtocol(asyncio.Protocol):
    """One HTTP/1.1 connection: httptools parses, the app answers (module docstring)."""

    def __init__(self, server: RawServer) -> None:
        self.server = server
        self.app = server.app
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.client: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None
        self.cycle: _Cycle | None = None  # the request being answered
        self.parsing: _Cycle | None = None  # the request whose body is being parsed
        self.pipeline: deque[_Cycle] = deque()
        self.write_paused: asyncio.Event | None = None  # set again when writing resumes
        self.reading_paused = False
        # The header phase (see turnstile.server.header_phase for the same rules).
        self.deadline: asyncio.TimerHandle | None = None
        self.awaiting_head = False
        self.received = False
        self.in_head = False
        self.head_bytes = 0
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []

    # -- connection -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        self.client = _address(transport.get_extra_info("peername"))
        self.local = _address(transport.get_extra_info("sockname"))
        self.server.connections.add(self)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self._stop_deadline()
        for cycle in (self.cycle, self.parsing, *self.pipeline):
            if cycle is not None:
                cycle.disconnected = True
                cycle.message_event.set()
        if self.write_paused is not None:
            self.write_paused.set()

    def pause_writing(self) -> None:
        self.write_paused = asyncio.Event()

    def resume_writing(self) -> None:
        if self.write_paused is not None:
            self.write_paused.set()
            self.write_paused = None

    def resume_reading(self) -> None:
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.received = True
        if self.in_head:  # counted as header_phase counts it
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # The request went to the app as plain HTTP (which answers an upgrade 426); the
            # parser stops here, so the connection closes after the answer.
            cycle = self.parsing
            if cycle is None or cycle.response_complete:
                self.transport.close()
                return
            cycle.keep_alive = False
            cycle.message_complete = True
            cycle.message_event.set()
            self._pause_reading()
            return
        except httptools.HttpParserError:
            self._refuse(BadRequest("invalid HTTP request"))
            return
        if self.in_head and self.head_bytes > self.server.max_head_bytes:
            limit = self.server.max_head_bytes
            self._refuse(HeadersTooLarge(f"the request line and headers exceed {limit} bytes"))

    def shutdown(self) -> None:
        """Close now if idle; otherwise after the response in progress."""
        if self.cycle is None:
            self.transport.close()
        else:
            self.cycle.keep_alive = False
            self.pipeline.clear()

    # -- httptools callbacks ----------------------------------------------------------
    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.in_head = True
        self.head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.awaiting_head = False
        self._stop_deadline()
        parsed = httptools.parse_url(self.url)
        raw_path = parsed.path
        path = raw_path.decode("ascii")
        if "%" in path:
            from urllib.parse import unquote

            path = unquote(path)
        parser = self.parser
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": _ASGI,
            "http_version": parser.get_http_version(),
            "method": parser.get_method().decode("ascii"),
            "scheme": "http",
            "path": path,
            "raw_path": raw_path,
            "query_string": parsed.query or b"",
            "root_path": "",
            "headers": self.headers,
            "client": self.client,
            "server": self.local,
            "state": dict(self.server.state),
        }
        expect = any(n == b"expect" and v.lower() == b"100-continue" for n, v in self.headers)
        cycle = _Cycle(self, scope, parser.should_keep_alive(), expect)
        self.parsing = cycle
        if self.cycle is None:
            self._run(cycle)
        else:
            self.pipeline.append(cycle)
            self._pause_reading()

    def on_body(self, body: bytes) -> None:
        cycle = self.parsing
        if cycle is None or cycle.response_complete or cycle.disconnected:
            return
        cycle.body += body
        if len(cycle.body) > READ_HIGH_WATER:
            self._pause_reading()
        cycle.message_event.set()

    def on_message_complete(self) -> None:
        cycle = self.parsing
        if cycle is None:
            return
        cycle.message_complete = True
        cycle.message_event.set()

    # -- answering --------------------------------------------------------------------
    def _run(self, cycle: _Cycle) -> None:
        self.cycle = cycle
        task = self.loop.create_task(self._answer(cycle))
        self.server.tasks.add(task)
        task.add_done_callback(self.server.tasks.discard)

    async def _answer(self, cycle: _Cycle) -> None:
        try:
            await self.app(cycle.scope, cycle.receive, cycle.send)
        except asyncio.CancelledError:  # the server is stopping
            self._fail(cycle)
        except Exception as exc:
            log.error("exception in the app on %s", cycle.scope["path"], exc_info=exc)
            self._fail(cycle)
        else:
            if not cycle.response_complete and not cycle.disconnected:
                log.error("the app returned without completing its response")
                self._fail(cycle)
        finally:
            self._response_complete()

    def _fail(self, cycle: _Cycle) -> None:
        if not cycle.response_started and not cycle.disconnected:
            cycle.response_started = cycle.response_complete = True
            self.transport.write(_INTERNAL_ERROR)
        self.transport.close()

    def _response_complete(self) -> None:
        self.cycle = None
        if self.transport.is_closing():
            return
        if self.pipeline:  # already parsed: its head is complete
            self._run(self.pipeline.popleft())
            self.resume_reading()
            return
        self.resume_reading()
        self._await_head()

    def _pause_reading(self) -> None:
        if not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    # -- the header phase ---------------------------------------------------------------
    def _await_head(self) -> None:
        self._stop_deadline()
        self.awaiting_head = True
        self.received = False
        self.deadline = self.loop.call_later(self.server.header_timeout_s, self._head_timed_out)

    def _stop_deadline(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _head_timed_out(self) -> None:
        self.deadline = None
        if not self.awaiting_head or self.transport.is_closing():
            return
        if not self.received:
            self.awaiting_head = False
            self.transport.close()  # nothing of a request arrived: an idle connection
            return
        timeout = self.server.header_timeout_s
        self._refuse(RequestTimeout(f"the request headers did not arrive within {timeout:g} s"))

    def _refuse(self, exc: TurnstileError) -> None:
        """Answer `exc` (OpenAI-style JSON, `Connection: close`) and close the connection."""
        self.awaiting_head = self.in_head = False
        self._stop_deadline()
        if self.transport.is_closing():
            return
        if self.cycle is not None and self.cycle.response_started:
            self.transport.close()  # mid-response: nothing more can be said
            return
        if self.cycle is not None:
            self.cycle.response_started = self.cycle.response_complete = True
        body = exc.body_bytes()
        self.transport.write(
            b"".join(
                [
                    status_line(exc.status),
                    _Date.get(),
                    b"content-type: application/json\r\n",
                    b"content-length: " + str(len(body)).encode() + b"\r\n",
                    b"connection: close\r\n\r\n",
                    body,
                ]
            )
        )
        self.transport.close()


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run `main` on uvloop where it is installed (as uvicorn does), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def _address(info: Any) -> tuple[str, int] | None:
    if isinstance(info, tuple) and len(info) >= 2:
        return str(info[0]), int(info[1])
    return None


class _Lifespan:
    """Runs the app's lifespan: start-up before listening, shutdown at the end."""

    def __init__(self, app: ASGIApp, state: dict[str, Any]) -> None:
        self.app = app
        self.state = state
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.started = asyncio.Event()
        self.stopped = asyncio.Event()
        self.failure: str | None = None
        self.task: asyncio.Task[None] | None = None

    async def startup(self) -> None:
        scope = {"type": "lifespan", "asgi": _ASGI, "state": self.state}
        self.task = asyncio.ensure_future(self._run(scope))
        await self.inbox.put({"type": "lifespan.startup"})
        await self.started.wait()
        if self.failure is not None:
            raise RuntimeError(f"the app's start-up failed: {self.failure}")

    async def shutdown(self) -> None:
        if self.task is None or self.task.done():
            return
        await self.inbox.put({"type": "lifespan.shutdown"})
        await self.stopped.wait()

    async def _run(self, scope: dict[str, Any]) -> None:
        try:
            await self.app(scope, self.inbox.get, self._send)
        except Exception as exc:
            log.exception("the app's lifespan failed")
            self.failure = self.failure or repr(exc)
        finally:
            self.started.set()
            self.stopped.set()

    async def _send(self, message: Message) -> None:
        kind = message["type"]
        if kind in ("lifespan.startup.complete", "lifespan.startup.failed"):
            if kind.endswith("failed"):
                self.failure = message.get("message", "") or "lifespan.startup.failed"
            self.started.set()
        elif kind in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
            if kind.endswith("failed"):
                log.error("the app's shutdown failed: %s", message.get("message", ""))
            self.stopped.set()


class RawServer:
    """Serves `app` with `RawHTTPProtocol` until stopped (see the module docstring).

    `serve()` runs in the current event loop; `stop()` may be called from any thread.
    With a `proxy`, the first SIGTERM/SIGINT drains it for up to `drain_timeout_s`
    before the listeners close; a second signal stops at once.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        header_timeout_s: float = HEADER_READ_TIMEOUT_S,
        max_head_bytes: int = MAX_REQUEST_HEAD_BYTES,
        proxy: Proxy | None = None,
        drain_timeout_s: float = 0.0,
        on_started: Callable[[], None] | None = None,
        install_signal_handlers: bool = True,
    ) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.header_timeout_s = header_timeout_s
        self.max_head_bytes = max_head_bytes
        self.proxy = proxy
        self.drain_timeout_s = drain_timeout_s
        self.on_started = on_started
        self.install_signal_handlers = install_signal_handlers
        self.state: dict[str, Any] = {}
        self.connections: set[RawHTTPProtocol] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exit: asyncio.Event | None = None
        self._drain: asyncio.Task[None] | None = None

    def stop(self) -> None:
        """Stop serving (thread-safe): close the listeners, finish, run the shutdown."""
        if self._loop is not None and self._exit is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: stopped
                self._loop.call_soon_threadsafe(self._exit.set)

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        run_loop(self.serve(sockets))

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._exit = asyncio.Event()
        lifespan = _Lifespan(self.app, self.state)
        await lifespan.startup()
        servers: list[asyncio.Server] = []
        try:
            if sockets:
                for sock in sockets:
                    servers.append(
                        await loop.create_server(
                            lambda: RawHTTPProtocol(self), sock=sock, backlog=LISTEN_BACKLOG
                        )
                    )
            else:
                servers.append(
                    await loop.create_server(
                        lambda: RawHTTPProtocol(self),
                        self.host,
                        self.port,
                        backlog=LISTEN_BACKLOG,
                        reuse_address=True,
                    )
                )
            if self.install_signal_handlers:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(sig, self._signalled)
            self.started = True
            if self.on_started is not None:
                self.on_started()
            await self._exit.wait()
        finally:
            if self.install_signal_handlers:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)
            for server in servers:
                server.close()
            await self._close_connections()
            await lifespan.shutdown()

    def _signalled(self) -> None:
        assert self._exit is not None
        if self._drain is None and self.proxy is not None and not self._exit.is_set():
            self.proxy.start_draining()
            log.info("draining: %d calls in flight", self.proxy.in_flight)
            self._drain = asyncio.ensure_future(self._drain_then_exit())
            return
        self._exit.set()

    async def _drain_then_exit(self) -> None:
        assert self.proxy is not None and self._exit is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proxy.idle.wait(), self.drain_timeout_s)
        self._exit.set()

    async def _close_connections(self) -> None:
        for conn in list(self.connections):
            conn.shutdown()
        deadline = time.monotonic() + max(self.drain_timeout_s, CLOSE_TIMEOUT_S)
        while self.connections and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(_CLOSE_POLL_S)
        for conn in list(self.connections):
            conn.transport.abort()
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
