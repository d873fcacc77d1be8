"""The Anthropic Messages and OpenAI Responses routes, plain ASGI like the completion routes.

`AgentProtocolRoutes` serves `POST /v1/messages`, `/v1/messages/count_tokens` and
`/v1/responses`, under `/rollouts/{rollout_id}/v1/...` too, and under
`/rollouts/{rollout_id}/...` without `/v1` (a client given `base_url=.../rollouts/{id}`
that adds only the route, as the `openai` SDK does). Each call is translated
(`turnstile.protocols`) into a Chat Completions call through `Proxy.complete`, so it is
recorded as one chat turn with the backend's exact token ids, in record and TITO mode
alike, and its answer is translated back: whole, or live, event by event, as the chat
stream arrives. A request the translation refuses never reaches the proxy: nothing is
recorded. Errors go out in the protocol's own shape. `count_tokens` asks the backend's
`/tokenize` with the translated messages (nothing is recorded). A WebSocket upgrade of
`/v1/responses` (Codex tries one first) is answered 426 at once, so the client falls back
to HTTP without reconnect delays.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any, Final

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from turnstile.backends.protocol import read_error
from turnstile.errors import BackendError, BadRequest, MethodNotAllowed, TurnstileError
from turnstile.protocols import messages, responses
from turnstile.protocols.common import StreamTranslator, translate_stream
from turnstile.protocols.conversations import ConversationStore
from turnstile.protocols.messages_stream import MessagesStream
from turnstile.protocols.responses_stream import ResponsesStream
from turnstile.proxy.capture import CHAT
from turnstile.proxy.core import Proxy, Relay, StreamRelay
from turnstile.server.asgi import BodyReader
from turnstile.server.routes.completions import (
    call_headers,
    complete_or_cancel,
    operation,
    send_relay,
)

log = logging.getLogger("turnstile.agent_protocols")

_ROUTE: Final[re.Pattern[str]] = re.compile(
    r"^(?:/rollouts/(?P<rid>[^/]+)(?:/v1)?|/v1)/(?P<ep>messages|messages/count_tokens|responses)$"
)
_JSON: Final[str] = "application/json"
_SSE: Final[str] = "text/event-stream"
UPGRADE_REQUIRED: Final[int] = 426
_UPGRADE_BODY: Final[bytes] = orjson.dumps(
    {
        "error": {
            "message": "Turnstile serves /v1/responses over HTTP only; use POST",
            "type": "invalid_request_error",
            "param": None,
            "code": "websocket_not_supported",
        }
    }
)


def _openai_error(exc: TurnstileError) -> bytes:
    return exc.body_bytes() if not isinstance(exc, BackendError) else _plain(exc).body_bytes()


def _plain(exc: TurnstileError) -> TurnstileError:
    """A backend's error as Turnstile's own body (a relayed body is in the chat dialect)."""
    plain = TurnstileError(exc.message, param=exc.param, code=exc.code)
    plain.status, plain.error_type = exc.status, exc.error_type
    return plain


class AgentProtocolRoutes:
    """Serves the Messages and Responses routes; everything else goes to `app`."""

    def __init__(
        self, app: ASGIApp, proxy: Proxy, bodies: BodyReader, conversations: ConversationStore
    ) -> None:
        self.app = app
        self.proxy = proxy
        self.bodies = bodies
        self.conversations = conversations

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        match = _ROUTE.fullmatch(scope["path"]) if kind in ("http", "websocket") else None
        if match is None:
            await self.app(scope, receive, send)
            return
        endpoint, rid = match["ep"], match["rid"]
        if kind == "websocket":
            await _refuse_websocket(scope, receive, send)
            return
        shape = messages.error_body if endpoint.startswith("messages") else _openai_error
        if scope["method"] != "POST":
            if _wants_websocket(scope):
                await _send(send, UPGRADE_REQUIRED, _JSON, _UPGRADE_BODY)
                return
            refused = MethodNotAllowed(f"method {scope['method']} not allowed on {scope['path']}")
            await _send(send, refused.status, _JSON, shape(refused))
            return
        try:
            if endpoint == "messages":
                result = await self._messages(scope, receive, rid)
            elif endpoint == "responses":
                result = await self._responses(scope, receive, rid)
            else:
                result = await self._count_tokens(scope, receive, rid)
            if result is None:  # the client went away; the call is recorded as aborted
                return
        except TurnstileError as exc:
            if exc.status >= 500:
                log.warning("POST %s -> %d: %s", scope["path"], exc.status, exc.message)
            await _send(send, exc.status, _JSON, shape(exc), exc.headers())
            return
        except Exception:
            log.exception("unexpected error on POST %s", scope["path"])
            error = TurnstileError("internal error in Turnstile")
            await _send(send, error.status, _JSON, shape(error))
            return
        await send_relay(scope, receive, send, result)

    async def _body(self, scope: Scope, receive: Receive, rid: str | None) -> tuple[Any, Any]:
        headers = call_headers(scope, rid)
        raw = await self.bodies.read(receive, headers.content_length)
        try:
            return orjson.loads(raw), headers
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"the request body is not valid JSON: {exc}") from None

    async def _messages(
        self, scope: Scope, receive: Receive, rid: str | None
    ) -> Relay | StreamRelay | None:
        body, headers = await self._body(scope, receive, rid)
        chat, call = messages.to_chat(body)
        result = await complete_or_cancel(
            self.proxy, scope, receive, CHAT, orjson.dumps(chat), headers
        )
        if result is None or isinstance(result, StreamRelay):
            return _stream(result, MessagesStream(call))
        return _whole(result, messages.from_chat(_chat_answer(result), call))

    async def _responses(
        self, scope: Scope, receive: Receive, rid: str | None
    ) -> Relay | StreamRelay | None:
        body, headers = await self._body(scope, receive, rid)
        chat, call = responses.to_chat(body, self.conversations.conversation)
        store = _storer(self.conversations, call, body)
        result = await complete_or_cancel(
            self.proxy, scope, receive, CHAT, orjson.dumps(chat), headers
        )
        if result is None or isinstance(result, StreamRelay):
            return _stream(result, ResponsesStream(call, store))
        answer, message = responses.from_chat(_chat_answer(result), call)
        store(message)
        return _whole(result, answer)

    async def _count_tokens(self, scope: Scope, receive: Receive, rid: str | None) -> Relay:
        body, _ = await self._body(scope, receive, rid)
        chat, _call = messages.to_chat(body, count_only=True)
        request = {"model": chat["model"], "messages": chat["messages"]}
        if chat.get("tools"):
            request["tools"] = chat["tools"]
        if chat.get("chat_template_kwargs"):
            request["chat_template_kwargs"] = chat["chat_template_kwargs"]
        resp = await self.proxy.backend.request(
            "POST", "/tokenize", orjson.dumps(request), {"Content-Type": _JSON}
        )
        try:
            if resp.status >= 400:
                raise await read_error(resp)
            raw = await resp.read()
        finally:
            resp.close()
        try:
            count = orjson.loads(raw)["count"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            count = None
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise BackendError("the backend's /tokenize answer has no token count")
        return Relay(200, _JSON, orjson.dumps({"input_tokens": count}))


def _storer(
    store: ConversationStore, call: responses.ResponsesCall, body: Any
) -> Callable[[dict[str, Any]], None]:
    """Stores the answer's conversation step, unless the client asked not to (`store:
    false`, as Codex sends with the whole conversation every call)."""

    def save(message: dict[str, Any]) -> None:
        if body.get("store") is not False:
            store.store(call.response_id, call.previous_response_id, [*call.added, message])

    return save


def _chat_answer(result: Relay) -> dict[str, Any]:
    try:
        obj = orjson.loads(result.body)
    except orjson.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict):
        raise BackendError("the chat answer to translate is not a JSON object")
    return obj


def _whole(result: Relay, answer: dict[str, Any]) -> Relay:
    return Relay(result.status, _JSON, orjson.dumps(answer), result.headers)


def _stream(result: StreamRelay | None, translator: StreamTranslator) -> StreamRelay | None:
    if result is None:
        return None
    chunks = translate_stream(result.chunks, translator)
    return StreamRelay(result.status, _SSE, chunks, result.headers)


def _wants_websocket(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"upgrade" and value.lower() == b"websocket":
            return True
    return False


async def _refuse_websocket(scope: Scope, receive: Receive, send: Send) -> None:
    """426 for a WebSocket handshake, as an HTTP response where the server can send one."""
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    if "websocket.http.response" in scope.get("extensions", {}):
        headers = [
            (b"content-type", _JSON.encode()),
            (b"content-length", str(len(_UPGRADE_BODY)).encode()),
        ]
        await send(
            {
                "type": "websocket.http.response.start",
                "status": UPGRADE_REQUIRED,
                "headers": headers,
            }
        )
        await send({"type": "websocket.http.response.body", "body": _UPGRADE_BODY})
        return
    await send({"type": "websocket.close", "code": 1008})


async def _send(
    send: Send, status: int, content_type: str, body: bytes, extra: dict[str, str] | None = None
) -> None:
    headers = [
        (b"content-type", content_type.encode("latin-1")),
        (b"content-length", str(len(body)).encode()),
    ]
    headers += [
        (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (extra or {}).items()
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def openapi_paths() -> dict[str, dict[str, Any]]:
    """The OpenAPI path items of the routes `AgentProtocolRoutes` serves (the forms without
    `/v1` under a rollout are aliases, left out)."""
    paths: dict[str, dict[str, Any]] = {}
    for route, name in (
        ("messages", "Messages"),
        ("messages/count_tokens", "Count Tokens"),
        ("responses", "Responses"),
    ):
        slug = route.replace("/", "_")
        paths[f"/v1/{route}"] = operation(name, f"{slug}_v1_{slug}_post", in_rollout=False)
        paths[f"/rollouts/{{rollout_id}}/v1/{route}"] = operation(
            f"Rollout {name}",
            f"rollout_{slug}_rollouts__rollout_id__v1_{slug}_post",
            in_rollout=True,
        )
    return paths
