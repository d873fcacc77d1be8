"""The completion routes: a plain ASGI app in front of FastAPI, their only implementation.

Chat and completions calls are the proxy's hot path: every one of them would otherwise
cross FastAPI's and Starlette's layers (exception middleware, async exit stacks, route
matching over the whole table, a `Request` object, dependency resolution), which cost
more CPU than forwarding the call itself. `CompletionFastPath` serves exactly these four
routes, `POST /v1/chat/completions`, `POST /v1/completions` and their
`/rollouts/{rollout_id}/` forms (a rollout may also be named by the `X-Turnstile-Rollout`
header), and passes everything else on; other methods on the rollout forms answer 405.
It sits inside the authentication middleware. FastAPI has no route for them: they
appear in its OpenAPI schema through `openapi_paths`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from dataclasses import dataclass
from typing import Any, Final

from starlette.types import ASGIApp, Receive, Scope, Send

from turnstile.errors import BadRequest, MethodNotAllowed, TurnstileError
from turnstile.limits import MAX_POLICY_VERSION, MIN_POLICY_VERSION
from turnstile.proxy.capture import CHAT, COMPLETIONS
from turnstile.proxy.core import Proxy, Relay, StreamRelay
from turnstile.proxy.rollouts import check_rollout_id
from turnstile.server.asgi import BodyReader, send_error
from turnstile.server.routes.api import StreamingRelayResponse, wait_disconnect

log = logging.getLogger("turnstile.completions")

ROLLOUT_HEADER: Final[str] = "x-turnstile-rollout"
POLICY_HEADER: Final[str] = "x-turnstile-policy-version"

_ROUTE: Final[re.Pattern[str]] = re.compile(
    r"^(?:/rollouts/(?P<rid>[^/]+))?/v1/(?P<ep>chat/completions|completions)$"
)
_ENDPOINTS: Final[dict[str, str]] = {"chat/completions": CHAT, "completions": COMPLETIONS}
_ROLLOUT: Final[bytes] = ROLLOUT_HEADER.encode()
_POLICY: Final[bytes] = POLICY_HEADER.encode()
_IDEMPOTENCY: Final[bytes] = b"idempotency-key"
_RETRY: Final[bytes] = b"x-stainless-retry-count"
_LENGTH: Final[bytes] = b"content-length"
# int() would also take "+1", " 1 " and "1_000"; a header is plain digits. 20 digits bound
# the work before the int64 check.
_INTEGER: Final[re.Pattern[bytes]] = re.compile(rb"-?[0-9]{1,20}")


class CompletionFastPath:
    """Serves POST chat/completions calls directly; everything else goes to `app`."""

    def __init__(self, app: ASGIApp, proxy: Proxy, bodies: BodyReader) -> None:
        self.app = app
        self.proxy = proxy
        self.bodies = bodies

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = _ROUTE.fullmatch(scope["path"]) if scope["type"] == "http" else None
        if match is not None and scope["method"] != "POST":
            if match["rid"] is not None:  # a rollout's completion route: POST only
                message = f"method {scope['method']} not allowed on {scope['path']}"
                await send_error(send, MethodNotAllowed(message))
                return
            match = None  # GET /v1/... passes through to the backend
        if match is None:
            await self.app(scope, receive, send)
            return
        try:
            result = await self._complete(scope, receive, _ENDPOINTS[match["ep"]], match["rid"])
            if result is None:  # the client went away; the call is recorded as aborted
                return
        except TurnstileError as exc:
            if exc.status >= 500:
                log.warning("POST %s -> %d: %s", scope["path"], exc.status, exc.message)
            await send_error(send, exc)
            return
        except Exception:
            log.exception("unexpected error on POST %s", scope["path"])
            await send_error(send, TurnstileError("internal error in Turnstile"))
            return
        await send_relay(scope, receive, send, result)

    async def _complete(
        self, scope: Scope, receive: Receive, endpoint: str, rollout_id: str | None
    ) -> Relay | StreamRelay | None:
        headers = call_headers(scope, rollout_id)
        raw = await self.bodies.read(receive, headers.content_length)
        return await complete_or_cancel(self.proxy, scope, receive, endpoint, raw, headers)


async def send_relay(
    scope: Scope, receive: Receive, send: Send, result: Relay | StreamRelay
) -> None:
    """Send the proxy's answer: a whole body, or a stream relayed as it comes."""
    if isinstance(result, StreamRelay):
        await StreamingRelayResponse(result)(scope, receive, send)
        return
    headers = [
        (b"content-type", result.content_type.encode("latin-1")),
        (b"content-length", str(len(result.body)).encode()),
    ]
    headers += [
        (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in result.headers.items()
    ]
    await send({"type": "http.response.start", "status": result.status, "headers": headers})
    await send({"type": "http.response.body", "body": result.body})


@dataclass(frozen=True, slots=True)
class CallHeaders:
    """What a completion call's headers (and path) say about it, checked."""

    rollout_id: str | None
    policy_version: int | None
    idempotency_key: str | None
    retry_count: str | None
    content_length: bytes | None


def call_headers(scope: Scope, rollout_id: str | None) -> CallHeaders:
    """The call's rollout (the path's, else the header's), policy version, retry headers and
    declared body size; 400 for a bad rollout id or policy version."""
    found: dict[bytes, bytes] = {}
    for name, value in scope["headers"]:
        if name in (_ROLLOUT, _POLICY, _IDEMPOTENCY, _RETRY, _LENGTH):
            found.setdefault(name, value)
    rid = rollout_id
    if rid is None and _ROLLOUT in found:
        rid = found[_ROLLOUT].decode("latin-1")
    if rid is not None:
        check_rollout_id(rid)
    return CallHeaders(
        rid,
        _policy_version(found.get(_POLICY)),
        _text(found.get(_IDEMPOTENCY)),
        _text(found.get(_RETRY)),
        found.get(_LENGTH),
    )


async def complete_or_cancel(
    proxy: Proxy, scope: Scope, receive: Receive, endpoint: str, raw: bytes, headers: CallHeaders
) -> Relay | StreamRelay | None:
    """`Proxy.complete` for the call; None when the client disconnected first."""
    call = asyncio.ensure_future(
        proxy.complete(
            endpoint,
            raw,
            rollout_id=headers.rollout_id,
            policy_version=headers.policy_version,
            idempotency_key=headers.idempotency_key,
            retry_count=headers.retry_count,
        )
    )
    # Until the answer (or a stream's first bytes) is ready, a client that disconnects
    # cancels the call: the backend request is closed and the turn recorded as aborted.
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait((call, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not call.done():
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        log.info("client disconnected from POST %s before the answer", scope["path"])
        return None
    return call.result()


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")


def _policy_version(value: bytes | None) -> int | None:
    """The header's policy version: a plain decimal integer within int64, else 400."""
    if value is None:
        return None
    shown = value.decode("latin-1")[:64]
    if _INTEGER.fullmatch(value) is None:
        raise BadRequest(
            f"{POLICY_HEADER} must be a decimal integer, got {shown!r}",
            param=POLICY_HEADER,
        )
    version = int(value)
    if not MIN_POLICY_VERSION <= version <= MAX_POLICY_VERSION:
        raise BadRequest(
            f"{POLICY_HEADER} must fit in a signed 64-bit integer, got {shown}",
            param=POLICY_HEADER,
        )
    return version


# -- the OpenAPI schema ------------------------------------------------------------------
_ANY_JSON: Final[dict[str, Any]] = {
    "description": "Successful Response",
    "content": {"application/json": {"schema": {}}},
}
_ROLLOUT_PARAMETER: Final[dict[str, Any]] = {
    "name": "rollout_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "title": "Rollout Id"},
}
_VALIDATION_ERROR: Final[dict[str, Any]] = {
    "description": "Validation Error",
    "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/HTTPValidationError"}}
    },
}


def operation(summary: str, operation_id: str, *, in_rollout: bool) -> dict[str, Any]:
    operation: dict[str, Any] = {"tags": ["openai"], "summary": summary}
    operation["operationId"] = operation_id
    if in_rollout:
        operation["parameters"] = [_ROLLOUT_PARAMETER]
        operation["responses"] = {"200": _ANY_JSON, "422": _VALIDATION_ERROR}
    else:
        operation["responses"] = {"200": _ANY_JSON}
    return {"post": operation}


def openapi_paths() -> dict[str, dict[str, Any]]:
    """The OpenAPI path items of the four completion routes `CompletionFastPath` serves."""
    return {
        "/v1/chat/completions": operation(
            "Chat", "chat_v1_chat_completions_post", in_rollout=False
        ),
        "/v1/completions": operation(
            "Completions", "completions_v1_completions_post", in_rollout=False
        ),
        "/rollouts/{rollout_id}/v1/chat/completions": operation(
            "Rollout Chat",
            "rollout_chat_rollouts__rollout_id__v1_chat_completions_post",
            in_rollout=True,
        ),
        "/rollouts/{rollout_id}/v1/completions": operation(
            "Rollout Completions",
            "rollout_completions_rollouts__rollout_id__v1_completions_post",
            in_rollout=True,
        ),
    }
