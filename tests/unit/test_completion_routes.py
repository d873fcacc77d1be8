"""The completion routes have one implementation, `CompletionFastPath`, and stay in the
OpenAPI schema although FastAPI has no route for them."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.routing import APIRoute
from starlette.routing import Match
from starlette.testclient import TestClient

from tests.unit.conftest import MakeApp
from turnstile.proxy.capture import CHAT as CHAT_ENDPOINT
from turnstile.proxy.capture import COMPLETIONS
from turnstile.proxy.core import Relay, StreamRelay
from turnstile.server.routes.completions import CompletionFastPath

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
PROMPT = {"model": "m", "prompt": "hi"}
# (path, schema path, endpoint, rollout, body)
ROUTES = [
    ("/v1/chat/completions", "/v1/chat/completions", CHAT_ENDPOINT, None, CHAT),
    ("/v1/completions", "/v1/completions", COMPLETIONS, None, PROMPT),
    (
        "/rollouts/r1/v1/chat/completions",
        "/rollouts/{rollout_id}/v1/chat/completions",
        CHAT_ENDPOINT,
        "r1",
        CHAT,
    ),
    (
        "/rollouts/r2/v1/completions",
        "/rollouts/{rollout_id}/v1/completions",
        COMPLETIONS,
        "r2",
        PROMPT,
    ),
]


def test_fastapi_has_no_completion_route(make_app: MakeApp) -> None:
    app = make_app().app
    for path, *_ in ROUTES:
        scope = {"type": "http", "method": "POST", "path": path}
        full = [r for r in app.router.routes if r.matches(scope)[0] is Match.FULL]
        assert not any(isinstance(r, APIRoute) and r.path.endswith("completions") for r in full)


def test_every_completion_route_reaches_the_one_handler(
    make_app: MakeApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, str, str | None]] = []
    handler = CompletionFastPath._complete

    async def counted(
        self: CompletionFastPath, scope: Any, receive: Any, endpoint: str, rollout_id: str | None
    ) -> Relay | StreamRelay | None:
        calls.append((scope["path"], endpoint, rollout_id))
        return await handler(self, scope, receive, endpoint, rollout_id)

    monkeypatch.setattr(CompletionFastPath, "_complete", counted)
    h = make_app()
    with TestClient(h.app) as client:
        for path, _, endpoint, rollout, body in ROUTES:
            resp = client.post(path, json=body)
            assert resp.status_code == 200, resp.text
            if rollout is not None:
                assert resp.headers["X-Turnstile-Rollout"] == rollout
            assert calls[-1] == (path, endpoint, rollout)
    assert [c[0] for c in calls] == [path for path, *_ in ROUTES]
    assert len(h.sink.turns) == len(ROUTES)


def test_other_methods_on_completion_routes(make_app: MakeApp) -> None:
    h = make_app()
    with TestClient(h.app) as client:
        for path in ("/rollouts/r/v1/chat/completions", "/rollouts/r/v1/completions"):
            resp = client.get(path)
            assert resp.status_code == 405
            assert resp.json()["error"]["type"] == "invalid_request_error"
    assert h.sink.turns == []


def test_openapi_lists_the_completion_routes(make_app: MakeApp) -> None:
    with TestClient(make_app().app) as client:
        schema = client.get("/openapi.json").json()
    paths = schema["paths"]
    for _, schema_path, *_ in ROUTES:
        operation = paths[schema_path]["post"]
        assert operation["tags"] == ["openai"]
        assert "200" in operation["responses"]
        params = [p["name"] for p in operation.get("parameters", [])]
        assert params == (["rollout_id"] if "{rollout_id}" in schema_path else [])
    ids = [op["operationId"] for item in paths.values() for op in item.values()]
    assert len(ids) == len(set(ids))
    assert list(paths)[: len(ROUTES)] == [schema_path for _, schema_path, *_ in ROUTES]
