"""Plain-ASGI helpers shared by the routes, the fast path and the middlewares.

One bounded body reader (413 before more than the limit is buffered, by Content-Length
or while reading a chunked body; 408 when the body does not arrive in time), the
`BodyReader` that also bounds the bytes buffered by all requests together (503), the
`HeaderLimits` middleware (431), and one way to send a `TurnstileError` as an OpenAI-style
response, for code that runs below FastAPI's exception handlers.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from turnstile.errors import (
    BadRequest,
    HeadersTooLarge,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    TurnstileError,
)
from turnstile.limits import (
    MAX_BUFFERED_BODY_BYTES,
    MAX_REQUEST_HEADER_BYTES,
    MAX_REQUEST_HEADERS,
    REQUEST_BODY_READ_TIMEOUT_S,
)

# How long a client refused for lack of buffer space is asked to wait.
BUFFER_FULL_RETRY_AFTER_S = 1


async def read_body(
    receive: Receive,
    declared: bytes | str | None,
    limit: int,
    timeout_s: float = REQUEST_BODY_READ_TIMEOUT_S,
    budget: BodyReader | None = None,
) -> bytes:
    """The request body, refused with 413 before more than `limit` bytes are buffered and
    with 408 when it takes longer than `timeout_s` to arrive; with a `budget`, its bytes
    count against it while they are read (503 when it is spent)."""
    if declared is not None:
        size = _declared_size(declared)
        if size > limit:
            raise PayloadTooLarge(f"request body of {size} bytes exceeds the limit of {limit}")
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_all(receive, limit, budget)
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s") from None


def _declared_size(declared: bytes | str) -> int:
    try:
        size = int(declared)
    except ValueError:
        raise BadRequest("invalid Content-Length header") from None
    if size < 0:
        raise BadRequest("invalid Content-Length header")
    return size


async def _read_all(receive: Receive, limit: int, budget: BodyReader | None) -> bytes:
    parts: list[bytes] = []
    total = 0
    taken = 0  # of `budget`, given back whatever happens
    try:
        while True:
            message: Message = await receive()
            if message["type"] == "http.disconnect":
                raise BadRequest("the client disconnected before sending the whole body")
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            if budget is not None:
                budget.take(len(chunk))
                taken += len(chunk)
            parts.append(chunk)
            if not message.get("more_body", False):
                return parts[0] if len(parts) == 1 else b"".join(parts)
    finally:
        if budget is not None:
            budget.give_back(taken)


class BodyReader:
    """Reads request bodies within three bounds: `limit` bytes each (413), `timeout_s` to
    arrive (408), and `budget` bytes buffered by all requests being read together (503
    with Retry-After, so a crowd of slow or large uploads cannot exhaust memory)."""

    def __init__(
        self,
        limit: int,
        *,
        budget: int = MAX_BUFFERED_BODY_BYTES,
        timeout_s: float = REQUEST_BODY_READ_TIMEOUT_S,
    ) -> None:
        self.limit = limit
        self.budget = budget
        self.timeout_s = timeout_s
        self.buffered = 0

    def take(self, size: int) -> None:
        if self.buffered + size > self.budget:
            raise Overloaded(
                f"{self.buffered} bytes of request bodies are being read; the limit is "
                f"{self.budget}",
                retry_after_s=BUFFER_FULL_RETRY_AFTER_S,
            )
        self.buffered += size

    def give_back(self, size: int) -> None:
        self.buffered -= size

    async def read(self, receive: Receive, declared: bytes | str | None) -> bytes:
        """The whole body (see the class docstring for the bounds)."""
        return await read_body(receive, declared, self.limit, self.timeout_s, budget=self)


class HeaderLimits:
    """Refuses a request with too many headers, or too many bytes of them, with 431."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_headers: int = MAX_REQUEST_HEADERS,
        max_bytes: int = MAX_REQUEST_HEADER_BYTES,
    ) -> None:
        self.app = app
        self.max_headers = max_headers
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope["headers"]
            if len(headers) > self.max_headers:
                await send_error(
                    send,
                    HeadersTooLarge(f"{len(headers)} request headers; at most {self.max_headers}"),
                )
                return
            size = sum(len(name) + len(value) for name, value in headers)
            if size > self.max_bytes:
                await send_error(
                    send,
                    HeadersTooLarge(f"{size} bytes of request headers; at most {self.max_bytes}"),
                )
                return
        await self.app(scope, receive, send)


async def send_error(send: Send, exc: TurnstileError) -> None:
    """Send `exc` as its status, its extra headers and its OpenAI-style JSON body."""
    body = exc.body_bytes()
    content_type = getattr(exc, "content_type", "application/json")
    headers = [
        (b"content-type", content_type.encode("latin-1")),
        (b"content-length", str(len(body)).encode()),
    ]
    headers += [
        (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in exc.headers().items()
    ]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
