"""Client and admin authentication: a pure ASGI middleware in front of every route.

Every route but `/health` needs a client key when client keys are configured
(`Authorization: Bearer <key>`). When an admin key is configured, `/admin/*` and the
reward route take only the admin key. Keys are compared in constant time against every
configured key; a 401 body says only that the key is missing or wrong. The client's
Authorization header is never forwarded to the backend (the proxy sends only the
backend's own key).
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from turnstile.errors import Unauthorized

# Routes open without a key: liveness probes run without credentials.
OPEN_PATHS = frozenset({"/health"})
ADMIN_PATH = re.compile(r"^/admin(/|$)|^/rollouts/[^/]+/rewards$")


def _key_bytes(keys: Sequence[str]) -> tuple[bytes, ...]:
    return tuple(k.encode("utf-8") for k in keys)


def _matches(presented: bytes, keys: tuple[bytes, ...]) -> bool:
    ok = False
    for key in keys:  # no early exit: time does not depend on which key matched
        ok |= hmac.compare_digest(presented, key)
    return ok


def _bearer(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token:
                return bytes(token.strip())
            return None
    return None


class AuthMiddleware:
    """Refuses requests without a valid key with an OpenAI-style 401."""

    def __init__(
        self, app: ASGIApp, *, client_keys: Sequence[str], admin_keys: Sequence[str] = ()
    ) -> None:
        self.app = app
        self.client_keys = _key_bytes(client_keys)
        self.admin_keys = _key_bytes(admin_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        admin_route = bool(self.admin_keys) and ADMIN_PATH.match(scope["path"]) is not None
        keys = self.admin_keys if admin_route else self.client_keys
        if not keys:
            await self.app(scope, receive, send)
            return
        token = _bearer(scope)
        if token is not None and _matches(token, keys):
            await self.app(scope, receive, send)
            return
        what = "admin API key" if admin_route else "API key"
        err = Unauthorized(f"missing or invalid {what}")
        body = err.body_bytes()
        await send(
            {
                "type": "http.response.start",
                "status": err.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
