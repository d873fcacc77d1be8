"""Turnstile's exception hierarchy and its OpenAI-style error bodies.

Every foreign exception (aiohttp, OSError, orjson, pydantic) is translated at the
boundary where it arises into one of these classes, each of which carries the HTTP
status the client gets and an OpenAI-compatible `type`:

    TurnstileError (500, internal_error)
    ├── BadRequest (400, invalid_request_error)
    │   ├── PayloadTooLarge (413)
    │   └── MethodNotAllowed (405)
    ├── Unauthorized (401, authentication_error)
    ├── Forbidden (403, permission_error)       a rollout key used on another rollout
    ├── NotFound (404, not_found_error)
    ├── Conflict (409, conflict_error)          e.g. a turn on a sealed rollout
    ├── Unprocessable (422, invalid_request_error)
    ├── Overloaded (503, overloaded_error)      recorder queue full, shutting down
    │   └── TooManyRequests (429, rate_limit_error)  the harness is too far ahead
    └── BackendError (502, backend_error)       the backend could not be used
        ├── BackendUnreachable (502)
        ├── BackendTimeout (504)
        └── BackendStatusError (relays the backend's own status and body)
"""

from __future__ import annotations

from typing import Any

import orjson


class TurnstileError(Exception):
    """Base class: an error with an HTTP status and an OpenAI-style body."""

    status: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body the client receives."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }

    def body_bytes(self) -> bytes:
        return orjson.dumps(self.body())

    def headers(self) -> dict[str, str]:
        """Extra response headers (e.g. Retry-After)."""
        return {}


class BadRequest(TurnstileError):
    status = 400
    error_type = "invalid_request_error"


class PayloadTooLarge(BadRequest):
    status = 413


class MethodNotAllowed(BadRequest):
    status = 405


class RequestTimeout(BadRequest):
    """The client did not send its request headers, or its whole body, in time."""

    status = 408


class HeadersTooLarge(BadRequest):
    """Too many request headers, or too many bytes of them."""

    status = 431


class Unauthorized(TurnstileError):
    status = 401
    error_type = "authentication_error"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class Forbidden(TurnstileError):
    """A valid key used outside its scope (a rollout key on another rollout)."""

    status = 403
    error_type = "permission_error"


class NotFound(TurnstileError):
    status = 404
    error_type = "not_found_error"


class Conflict(TurnstileError):
    status = 409
    error_type = "conflict_error"


class Unprocessable(TurnstileError):
    status = 422
    error_type = "invalid_request_error"


class Overloaded(TurnstileError):
    """Turnstile cannot take the request now; the client should retry later."""

    status = 503
    error_type = "overloaded_error"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class TooManyRequests(Overloaded):
    """The client is ahead of what it may do now (admission control); retry later."""

    status = 429
    error_type = "rate_limit_error"


class BackendError(TurnstileError):
    status = 502
    error_type = "backend_error"


class BackendValueError(BackendError):
    """The backend answered with a value that cannot be recorded (a token id outside
    int32, a choice index out of bounds, a non-finite logprob): the turn is recorded as an
    error and the client gets a 502."""


class BackendUnreachable(BackendError):
    status = 502


class BackendTimeout(BackendError):
    status = 504


class BackendStatusError(BackendError):
    """The backend answered with an error status: relay its status and body."""

    def __init__(self, status: int, body: bytes, content_type: str | None) -> None:
        self.status = status
        self.raw_body = body
        self.content_type = content_type or "application/json"
        super().__init__(_message_from_body(body, status))

    def body_bytes(self) -> bytes:
        return self.raw_body if self.raw_body else super().body_bytes()


def _message_from_body(body: bytes, status: int) -> str:
    """Best-effort extraction of the backend's error message, for logs and records."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        text = body[:500].decode("utf-8", "replace").strip()
        return f"backend returned HTTP {status}: {text}" if text else f"HTTP {status}"
    if isinstance(parsed, dict):
        err = parsed.get("error", parsed)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(parsed.get("detail"), str):
            return str(parsed["detail"])
        if isinstance(err, str):
            return err
    return f"backend returned HTTP {status}"
