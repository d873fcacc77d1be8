"""HTTP routes: the rollout API, admin endpoints and the pass-through to the backend.

The completion routes (`/v1/chat/completions`, `/v1/completions` and their
`/rollouts/{rollout_id}/` forms) are not here: `turnstile.server.routes.completions`
serves them in front of FastAPI and lists them in the OpenAPI schema. Other `/v1/*`
paths and the vLLM helpers (`/tokenize`, `/detokenize`, `/version`) pass through to the
backend. Errors are OpenAI-style bodies with the status of the `turnstile.errors` class
that was raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from turnstile.errors import (
    BadRequest,
    Forbidden,
    MethodNotAllowed,
    NotFound,
    Overloaded,
    TurnstileError,
    Unprocessable,
)
from turnstile.jsontext import json_text
from turnstile.limits import ADMIN_FLUSH_TIMEOUT_S
from turnstile.proxy.core import Proxy, StreamRelay
from turnstile.proxy.rollouts import check_rollout_id
from turnstile.server import asgi
from turnstile.server.auth import RolloutKeys, may_post_rewards
from turnstile.server.bodies import (
    CreateRollout,
    FinishRollout,
    Pause,
    PolicyVersion,
    PostRewards,
    Resume,
)

log = logging.getLogger("turnstile.routes")

# The vLLM routes outside /v1 that a harness or trainer may call through the proxy.
PASSTHROUGH_EXTRA = ("/tokenize", "/detokenize", "/version")


class StreamingRelayResponse(Response):
    """Relays an async byte iterator, cancelling it as soon as the client disconnects.

    The iterator is closed explicitly in every case, so the proxy's `finally` records the
    turn and closes the upstream connection (which cancels the request in the backend).
    """

    def __init__(self, relay: StreamRelay) -> None:
        # Not Response.__init__: that renders an empty body and sets Content-Length: 0.
        self.status_code = relay.status
        self.media_type = relay.content_type
        self.background = None
        headers = {"Content-Type": relay.content_type, **relay.headers}
        if relay.content_type.startswith("text/event-stream"):
            headers.setdefault("Cache-Control", "no-cache")
            headers["X-Accel-Buffering"] = "no"
        self.init_headers(headers)
        self._chunks = relay.chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.ensure_future(self._send_all(send))
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({sender, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if sender not in done:
                sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await sender
        finally:
            watcher.cancel()
            aclose = getattr(self._chunks, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def _send_all(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        async for chunk in self._chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def wait_disconnect(receive: Receive) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return


def error_response(exc: TurnstileError) -> Response:
    return Response(
        exc.body_bytes(),
        status_code=exc.status,
        media_type=getattr(exc, "content_type", "application/json"),
        headers=exc.headers(),
    )


async def read_body(request: Request, bodies: asgi.BodyReader) -> bytes:
    """The request body, within the bounds of `bodies` (413, 408, 503)."""
    return await bodies.read(request.receive, request.headers.get("content-length"))


def _info_text(info: dict[str, Any]) -> dict[str, str | None]:
    """Verifier information as text: strings as given, anything else as JSON."""
    return {k: v if isinstance(v, str) or v is None else json_text(v) for k, v in info.items()}


def add_routes(
    router: APIRouter,
    proxy: Proxy,
    bodies: asgi.BodyReader,
    rollout_keys: RolloutKeys | None = None,
    tito_stats: Callable[[], dict[str, Any]] | None = None,
) -> None:
    """Add Turnstile's routes to `router` (the app's own, so the route table is flat).

    `tito_stats` reports TITO mode's counts in `/stats` (None in record mode).
    """

    @router.get("/health", tags=["admin"])
    async def health() -> Response:
        recorder = proxy.recorder
        journal_ok = proxy.journal.healthy
        ok = recorder.healthy and journal_ok and not proxy.draining
        incident = recorder.incident
        status = "ok" if incident is None else "degraded"
        body = {
            "status": status if ok else ("draining" if proxy.draining else "unhealthy"),
            "recorder": {
                "healthy": recorder.healthy,
                "error": recorder.error,
                "backlog": recorder.backlog,
                # Stays until acknowledged (POST /admin/recorder/ack): serving goes on.
                "incident": None if incident is None else incident.as_dict(),
                "quarantined": recorder.quarantined,
            },
            "journal": {"healthy": journal_ok, **_journal_usage(proxy)},
            "open_rollouts": proxy.registry.open_count,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    # Load balancers and `curl -I` probe with HEAD: the same status, no body.
    router.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)

    @router.get("/stats", tags=["admin"])
    async def stats() -> dict[str, Any]:
        s = proxy.recorder.stats
        return {
            "turns_received": s.turns_received,
            "turns_written": s.turns_written,
            "samples_written": s.samples_written,
            "rollouts_written": s.rollouts_written,
            "retokenized_turns": s.retokenized_turns,
            "dropped": s.dropped,
            "quarantined": proxy.recorder.quarantined,
            "recorder_errors": s.errors_total,
            "recorder_incident": (
                None if proxy.recorder.incident is None else proxy.recorder.incident.as_dict()
            ),
            "breaks_by_kind": dict(s.breaks_by_kind),
            "open_rollouts": proxy.registry.open_count,
            "open_rollout_bytes": proxy.registry.held_bytes,
            "in_flight": proxy.in_flight,
            "backlog": proxy.recorder.backlog,
            "policy_version": proxy.policy_version,
            "fence": proxy.fence.summary(),
            "admission": {
                "rollouts_per_version": proxy.admission.per_version,
                "max_staleness": proxy.admission.max_staleness,
                "created": proxy.admission.created,
                "refused": proxy.admission.refused,
                "allowance": proxy.admission.allowance,
                "ahead_versions": proxy.admission.ahead,
            },
            "journal": _journal_usage(proxy),
            "mode": "record" if tito_stats is None else "tito",
            "tito": None if tito_stats is None else tito_stats(),
        }

    @router.post("/rollouts", status_code=201, tags=["rollouts"])
    async def create_rollout(request: Request, body: CreateRollout | None = None) -> Any:
        body = body or CreateRollout()
        await proxy.admission.wait_for_room()
        rollout = proxy.registry.create(
            body.rollout_id,
            group_id=body.group_id,
            task_id=body.task_id,
            metadata=body.metadata,
            group_size=body.group_size,
        )
        await proxy.journal.durable()  # acknowledged means journaled
        base = str(request.base_url).rstrip("/")
        out = rollout.summary()
        out["base_url"] = f"{base}/rollouts/{rollout.rollout_id}/v1"
        # A key for this rollout only (when keys are required): hand it to the harness.
        out["api_key"] = rollout_keys.mint(rollout.rollout_id) if rollout_keys else None
        return out

    @router.get("/rollouts/{rollout_id}", tags=["rollouts"])
    async def get_rollout(rollout_id: str) -> Any:
        return proxy.registry.get(check_rollout_id(rollout_id)).summary()

    @router.get("/groups/{group_id}", tags=["rollouts"])
    async def get_group(group_id: str) -> Any:
        """A group's rollouts and whether it is complete (all declared rollouts sealed
        and handed to the writer, which then publishes it within `publish_delay_s`)."""
        return proxy.registry.group(group_id).summary()

    @router.post("/rollouts/{rollout_id}/rewards", tags=["rollouts"])
    async def post_rewards(rollout_id: str, body: PostRewards) -> Any:
        if not body.rewards and not body.info:
            raise Unprocessable("give at least one reward in 'rewards'", param="rewards")
        rollout = proxy.registry.add_rewards(
            check_rollout_id(rollout_id), body.rewards, _info_text(body.info)
        )
        await proxy.journal.durable()  # acknowledged means journaled
        return rollout.summary()

    @router.post("/rollouts/{rollout_id}/finish", tags=["rollouts"])
    async def finish_rollout(
        request: Request, rollout_id: str, body: FinishRollout | None = None
    ) -> Any:
        rid = check_rollout_id(rollout_id)
        if body is not None and (body.rewards or body.info):
            if not may_post_rewards(request.scope):
                raise Forbidden(
                    "rewards need the key that may post them (the admin key when one is "
                    "set); finish without rewards, or post them with that key",
                    param="rewards",
                )
            proxy.registry.add_rewards(rid, body.rewards, _info_text(body.info))
        rollout = proxy.registry.finish(rid)
        await proxy.journal.durable()  # acknowledged means journaled
        return rollout.summary()

    @router.get("/admin/policy_version", tags=["admin"])
    async def get_policy_version() -> dict[str, int]:
        return {"policy_version": proxy.policy_version}

    @router.post("/admin/policy_version", tags=["admin"])
    async def set_policy_version(body: PolicyVersion) -> dict[str, Any]:
        """Switch the policy version in one call. `keep` (default): calls in flight go on,
        the tokens streamed from now on carry the new version; `pause`: new calls wait,
        calls in flight finish, then the switch; `abort`: calls in flight are cut and
        recorded `aborted` (the harness gets a retryable error), then the switch."""
        return await proxy.switch_policy_version(body.policy_version, body.mode)

    @router.post("/admin/pause", tags=["admin"])
    async def pause(body: Pause | None = None) -> dict[str, Any]:
        """Before a weight push: new calls wait; calls in flight finish (`pause`) or are
        cut and recorded `aborted` (`abort`). Answers once none is in flight."""
        return await proxy.pause((body or Pause()).mode)

    @router.post("/admin/resume", tags=["admin"])
    async def resume(body: Resume | None = None) -> dict[str, Any]:
        """After a weight push: switch to the new policy version and let calls through."""
        return await proxy.resume((body or Resume()).policy_version)

    @router.post("/admin/flush", tags=["admin"])
    async def flush() -> dict[str, Any]:
        """Publish everything handed to the writer so far (sealed rollouts, turns), now;
        answers once it is in published shards."""
        await proxy.writer_has_everything()
        flush = proxy.recorder.request_flush()
        done = await asyncio.to_thread(flush.done.wait, ADMIN_FLUSH_TIMEOUT_S)
        if not done:
            raise Overloaded(
                f"the writer did not publish within {ADMIN_FLUSH_TIMEOUT_S:.0f} s; "
                "it is behind, retry shortly",
                retry_after_s=5,
            )
        if not flush.ok:
            raise Overloaded(
                f"publishing failed: {proxy.recorder.error}; it is retried", retry_after_s=5
            )
        return {"published": True, "backlog": proxy.recorder.backlog}

    @router.post("/admin/recorder/ack", tags=["admin"])
    async def acknowledge_incident() -> dict[str, Any]:
        """An operator has seen the recorder's incident (a failure or quarantined rows):
        clear it from /health, /stats and /metrics. The counters stay."""
        incident = proxy.recorder.acknowledge()
        if incident is not None:
            log.info("recorder incident acknowledged: %s", incident.message)
        return {"acknowledged": None if incident is None else incident.as_dict()}

    async def passthrough(request: Request) -> Response:
        path = passthrough_path(request.scope)
        body = await read_body(request, bodies) if request.method != "GET" else None
        if request.url.query:
            path += "?" + request.url.query
        result = await proxy.passthrough(
            request.method, path, body, request.headers.get("content-type")
        )
        return StreamingRelayResponse(result)

    passthrough_routes: list[tuple[str, tuple[str, ...], str]] = [
        ("/v1/{rest:path}", ("GET", "POST", "DELETE"), "openai")
    ]
    passthrough_routes += [(extra, ("GET", "POST"), "vllm") for extra in PASSTHROUGH_EXTRA]
    for path, methods, tag in passthrough_routes:
        for method in methods:
            slug = path.strip("/").split("/")[0]
            router.add_api_route(
                path,
                passthrough,
                methods=[method],
                tags=[tag],
                operation_id=f"passthrough_{slug}_{method.lower()}",
                summary=f"{method} passed through to the backend",
            )


# The completion routes: recorded by `turnstile.server.routes.completions` exactly as
# spelled here, so no other spelling of them may reach the backend unrecorded.
_COMPLETION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
# Percent-encodings that would let a path escape `/v1/` once the backend decodes it.
_ENCODED_ESCAPES = (b"%2f", b"%5c", b"%2e")


def passthrough_path(scope: Scope) -> str:
    """The path to forward, refused (400, or 404 for a completion route misspelt) unless it
    is plain: no dot segments, no empty segments, no encoded slash, backslash or dot. The
    backend (and the HTTP client's URL handling) would resolve those to another route than
    the one Turnstile matched, e.g. `/v1/../admin/...`."""
    path: str = scope["path"]
    raw = bytes(scope.get("raw_path") or path.encode("utf-8")).partition(b"?")[0].lower()
    if any(escape in raw for escape in _ENCODED_ESCAPES) or "\\" in path:
        raise BadRequest(f"{path!r:.200}: encoded slashes, backslashes or dots are not forwarded")
    segments = path.split("/")[1:]
    if any(segment in ("", ".", "..") for segment in segments[:-1]) or segments[-1] in (
        ".",
        "..",
    ):
        raise BadRequest(f"{path!r:.200}: dot segments and empty segments are not forwarded")
    if path.rstrip("/") in _COMPLETION_PATHS:
        raise NotFound(
            f"no route {path!r:.200}: completions are served (and recorded) at "
            f"{path.rstrip('/')} exactly"
        )
    return path


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TurnstileError)
    async def _turnstile_error(request: Request, exc: TurnstileError) -> Response:
        if exc.status >= 500:
            log.warning(
                "%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message
            )
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()
        )
        return error_response(Unprocessable(f"invalid request: {problems}"))

    @app.exception_handler(400)
    async def _bad_request(request: Request, exc: StarletteHTTPException) -> Response:
        # FastAPI's own: a body it could not parse (e.g. JSON nested past its parser).
        return error_response(BadRequest(f"invalid request: {exc.detail}"))

    @app.exception_handler(404)
    async def _not_found(request: Request, exc: Exception) -> Response:
        return error_response(NotFound(f"no route {request.method} {request.url.path}"))

    @app.exception_handler(405)
    async def _not_allowed(request: Request, exc: Exception) -> Response:
        return error_response(
            MethodNotAllowed(f"method {request.method} not allowed on {request.url.path}")
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(TurnstileError("internal error in Turnstile"))


def _journal_usage(proxy: Proxy) -> dict[str, int]:
    """Segments kept, their bytes, and segments removed once published (this run)."""
    segments = proxy.journal.segments()
    return {
        "segments": len(segments),
        "bytes": sum(s.size_bytes for s in segments),
        "segments_removed": proxy.journal.segments_removed,
    }
