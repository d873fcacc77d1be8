"""Plain-ASGI helpers shared by the routes, the fast path and the middlewares.

One bounded body reader (413 before more than the limit is buffered, by Content-Length
or while reading a chunked body) and one way to send a `TurnstileError` as an
OpenAI-style response, for code that runs below FastAPI's exception handlers.
"""

from __future__ import annotations

from starlette.types import Message, Receive, Send

from turnstile.errors import BadRequest, PayloadTooLarge, TurnstileError


async def read_body(receive: Receive, declared: bytes | str | None, limit: int) -> bytes:
    """The request body, refused with 413 before more than `limit` bytes are buffered."""
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise BadRequest("invalid Content-Length header") from None
        if size > limit:
            raise PayloadTooLarge(f"request body of {size} bytes exceeds the limit of {limit}")
    parts: list[bytes] = []
    total = 0
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            raise BadRequest("the client disconnected before sending the whole body")
        chunk = message.get("body", b"")
        total += len(chunk)
        if total > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        parts.append(chunk)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


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
