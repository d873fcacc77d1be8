"""Client and admin authentication: a pure ASGI middleware in front of every route.

Every route but `/health` needs a client key when client keys are configured
(`Authorization: Bearer <key>`, or Anthropic's `x-api-key: <key>` for clients of the
Messages API). When an admin key is configured, `/admin/*` and the
reward route take only the admin key. Keys are compared in constant time against every
configured key; a 401 body says only that the key is missing or wrong. The client's
Authorization header is never forwarded to the backend (the proxy sends only the
backend's own key).

Rollout keys: `POST /rollouts` answers with an `api_key` that works for that rollout
only (`tsr_<rollout id>.<HMAC-SHA256>`), for harnesses and sandboxes that should not
hold the client key. It opens the rollout's own routes (`/rollouts/{id}`, its
`/rollouts/{id}/v1/...` completion, Messages and Responses routes, the last two also
without `/v1`, and `/finish`, and `/v1/...` with `X-Turnstile-Rollout: {id}`)
and nothing else: another rollout, rewards and admin routes get 403, so a policy
cannot write into another rollout or grade itself. `/finish` with rewards in its body
needs the key that may post rewards (the admin key when one is set, else the client
key): the middleware records in the request's state whether the caller holds it
(`may_post_rewards`), and the finish route refuses rewards otherwise. The MAC key is
derived from the client keys, so rollout keys stay valid across restarts and die when the
keys rotate.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from turnstile.errors import Forbidden, TurnstileError, Unauthorized
from turnstile.server.asgi import send_error

# Routes open without a key: liveness probes run without credentials.
OPEN_PATHS = frozenset({"/health"})
ADMIN_PATH = re.compile(r"^/admin(/|$)|^/rollouts/[^/]+/rewards$")


ROLLOUT_KEY_PREFIX = b"tsr_"
# What a rollout key opens: its rollout's completion routes, its state and its finish
# (matched whole: `$` would also match before a trailing newline).
_ROLLOUT_PATH = re.compile(
    r"/rollouts/(?P<id>[^/]+)(?:/v1/(?:chat/completions|completions)|/finish"
    r"|(?:/v1)?/(?:messages|messages/count_tokens|responses))?"
)
_ROLLOUT_HEADER_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
    }
)
_ROLLOUT_HEADER = b"x-turnstile-rollout"
_FINISH_PATH = re.compile(r"^/rollouts/[^/]+/finish$")


class RolloutKeys:
    """Mints and checks rollout-scoped keys (see the module docstring)."""

    def __init__(self, client_keys: Sequence[str]) -> None:
        material = b"\0".join(sorted(_key_bytes(client_keys)))
        self._secret = hashlib.sha256(b"turnstile rollout keys\0" + material).digest()

    def _mac(self, rollout_id: bytes) -> bytes:
        return hmac.new(self._secret, rollout_id, hashlib.sha256).hexdigest().encode()

    def mint(self, rollout_id: str) -> str:
        rid = rollout_id.encode("utf-8")
        return (ROLLOUT_KEY_PREFIX + rid + b"." + self._mac(rid)).decode("ascii")

    def rollout_of(self, token: bytes) -> str | None:
        """The rollout a valid rollout key is for; None if it is not one."""
        if not token.startswith(ROLLOUT_KEY_PREFIX):
            return None
        rid, dot, mac = token[len(ROLLOUT_KEY_PREFIX) :].rpartition(b".")
        if not dot or not rid or not hmac.compare_digest(mac, self._mac(rid)):
            return None
        return rid.decode("utf-8", errors="replace")


def _rollout_allows(scope: Scope, rollout_id: str) -> bool:
    match = _ROLLOUT_PATH.fullmatch(scope["path"])
    if match is not None:
        return match["id"] == rollout_id
    if scope["path"] in _ROLLOUT_HEADER_PATHS:
        for name, value in scope.get("headers", ()):
            if name == _ROLLOUT_HEADER:
                return bool(value.decode("latin-1") == rollout_id)
    return False


def _key_bytes(keys: Sequence[str]) -> tuple[bytes, ...]:
    return tuple(k.encode("utf-8") for k in keys)


def _matches(presented: bytes, keys: tuple[bytes, ...]) -> bool:
    ok = False
    for key in keys:  # no early exit: time does not depend on which key matched
        ok |= hmac.compare_digest(presented, key)
    return ok


def _bearer(scope: Scope) -> bytes | None:
    """The key presented: `Authorization: Bearer <key>`, else Anthropic's `x-api-key`."""
    api_key: bytes | None = None
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token:
                return bytes(token.strip())
            return None
        if name == b"x-api-key" and api_key is None and value.strip():
            api_key = bytes(value.strip())
    return api_key


# The request-state key the middleware sets: whether this caller may post rewards.
MAY_POST_REWARDS = "turnstile.may_post_rewards"


def may_post_rewards(scope: Scope) -> bool:
    """Whether the request's caller holds the key that may post rewards (set by
    `AuthMiddleware`; an app without it has no keys, so anyone may)."""
    return bool(scope.get("state", {}).get(MAY_POST_REWARDS, True))


def _with_reward_right(scope: Scope, allowed: bool) -> Scope:
    return {**scope, "state": {**scope.get("state", {}), MAY_POST_REWARDS: allowed}}


class AuthMiddleware:
    """Refuses requests without a valid key with an OpenAI-style 401."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        client_keys: Sequence[str],
        admin_keys: Sequence[str] = (),
        rollout_keys: RolloutKeys | None = None,
    ) -> None:
        self.app = app
        self.client_keys = _key_bytes(client_keys)
        self.admin_keys = _key_bytes(admin_keys)
        self.rollout_keys = rollout_keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        admin_route = bool(self.admin_keys) and ADMIN_PATH.match(scope["path"]) is not None
        keys = self.admin_keys if admin_route else self.client_keys
        token = _bearer(scope)
        # Rewards (the reward route, or rewards in `/finish`) need the admin key when one
        # is set; without one, whoever may use the route may.
        admin = bool(self.admin_keys) and token is not None and _matches(token, self.admin_keys)
        rewarder = admin or not self.admin_keys
        if not keys:
            await self.app(_with_reward_right(scope, rewarder), receive, send)
            return
        if token is not None and _matches(token, keys):
            await self.app(_with_reward_right(scope, rewarder), receive, send)
            return
        if admin and _FINISH_PATH.match(scope["path"]) is not None:
            # `/finish` also takes the admin key, which may finish a rollout with rewards.
            await self.app(_with_reward_right(scope, True), receive, send)
            return
        rollout = None
        if token is not None and self.rollout_keys is not None:
            rollout = self.rollout_keys.rollout_of(token)
        err: TurnstileError
        if rollout is None:
            what = "admin API key" if admin_route else "API key"
            err = Unauthorized(f"missing or invalid {what}")
        elif ADMIN_PATH.match(scope["path"]) is None and _rollout_allows(scope, rollout):
            await self.app(_with_reward_right(scope, False), receive, send)
            return
        else:
            err = Forbidden("this key belongs to one rollout and cannot be used here")
        await send_error(send, err)
