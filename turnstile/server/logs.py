"""Logging: plain text or one JSON object per line, with request and rollout ids.

`setup_logging(level, "json")` makes every record a JSON line with `ts`, `level`,
`logger`, `msg` and, when the record was logged while serving a request, its
`request_id` and `rollout_id`. The ids live in context variables set by the ASGI
middleware `RequestContext`: the request id comes from the client's `X-Request-Id`
header (if it is a sane token) or is generated, and is echoed in the response's
`X-Request-Id`; the rollout id comes from the `/rollouts/{id}/...` path or the
`X-Turnstile-Rollout` header. Records logged by the writer thread carry no request.

Secrets: nothing here logs headers or bodies, and a `Bearer ...` token that ends up in
a message anyway (an exception text, say) is redacted before it is written.
"""

from __future__ import annotations

import contextvars
import logging
import re
import sys
import time
import uuid
from typing import Any, Final, Literal

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LogFormat = Literal["text", "json"]
LOG_FORMATS: Final[tuple[LogFormat, ...]] = ("text", "json")
TEXT_FORMAT: Final[str] = "%(asctime)s %(levelname)s %(name)s: %(message)s"

REQUEST_ID_HEADER: Final[str] = "x-request-id"
_ROLLOUT_HEADER: Final[bytes] = b"x-turnstile-rollout"
# A client-supplied request id is kept only if it is a short, plain token: it goes into
# every log line of the request, so it must not be able to inject text or bloat them.
MAX_REQUEST_ID_CHARS: Final[int] = 128
_SAFE_ID: Final[re.Pattern[str]] = re.compile(r"^[A-Za-z0-9._:\-]+$")
_ROLLOUT_PATH: Final[re.Pattern[str]] = re.compile(r"^/rollouts/([^/]+)")
_BEARER: Final[re.Pattern[str]] = re.compile(r"(?i)(bearer\s+)[^\s'\",]+")
# LogRecord attributes that are not user "extra" fields.
_STANDARD: Final[frozenset[str]] = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys() | {"message", "asctime"}
)

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "turnstile_request_id", default=None
)
rollout_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "turnstile_rollout_id", default=None
)


_FORMAT: LogFormat = "text"  # the format setup_logging installed


def redact(text: str) -> str:
    """`text` with bearer tokens replaced by `[redacted]`."""
    return _BEARER.sub(r"\1[redacted]", text)


class JSONFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, ids, extras, exception."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        request_id = getattr(record, "request_id", None) or request_id_var.get()
        rollout_id = getattr(record, "rollout_id", None) or rollout_id_var.get()
        if request_id is not None:
            out["request_id"] = request_id
        if rollout_id is not None:
            out["rollout_id"] = rollout_id
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc"] = redact(self.formatException(record.exc_info))
        return orjson.dumps(out, default=str).decode()


class _TextRedactor(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def make_formatter(fmt: LogFormat) -> logging.Formatter:
    if fmt == "json":
        return JSONFormatter()
    if fmt == "text":
        return _TextRedactor(TEXT_FORMAT)
    raise ValueError(f"unknown log format {fmt!r}; expected one of {LOG_FORMATS}")


def setup_logging(level: str, fmt: LogFormat = "text") -> None:
    """Configure the root logger once for the process: level and format, to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(make_formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    global _FORMAT
    _FORMAT = fmt


def adopt_uvicorn_loggers() -> None:
    """Send uvicorn's own loggers through the root handler (they carry their own).

    uvicorn configures its loggers when its `Config` is built, after `setup_logging`;
    this runs at application start-up, once that has happened.
    """
    if _FORMAT != "json":
        return
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def _request_id(scope: Scope) -> str:
    given = _header(scope, REQUEST_ID_HEADER.encode())
    if given and len(given) <= MAX_REQUEST_ID_CHARS and _SAFE_ID.match(given):
        return given
    return uuid.uuid4().hex


def _rollout_id(scope: Scope) -> str | None:
    match = _ROLLOUT_PATH.match(scope.get("path", ""))
    rid = match.group(1) if match else _header(scope, _ROLLOUT_HEADER)
    if rid and len(rid) <= MAX_REQUEST_ID_CHARS and _SAFE_ID.match(rid):
        return rid
    return None


class RequestContext:
    """Pure ASGI middleware: sets the log context ids for the request's lifetime."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            adopt_uvicorn_loggers()
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id(scope)
        header = (REQUEST_ID_HEADER.encode(), request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        tokens = (request_id_var.set(request_id), rollout_id_var.set(_rollout_id(scope)))
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(tokens[0])
            rollout_id_var.reset(tokens[1])
