"""Where the Messages and Responses routes are served (top level, under a rollout, with and
without `/v1`), their keys (`x-api-key`, rollout keys), the WebSocket refusal, and live
streaming: the first translated delta reaches the client before the backend's last token."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient, WebSocketDenialResponse

from tests.fakes_backend import Reply
from tests.live import LiveServer
from tests.unit.conftest import MakeApp

MODEL = "fake-model"
MESSAGES: Any = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES: Any = {"model": MODEL, "input": "hi"}
KEY = "sk-client"


@pytest.mark.parametrize(
    ("path", "body", "rollout"),
    [
        ("/v1/messages", MESSAGES, None),
        ("/rollouts/r1/v1/messages", MESSAGES, "r1"),
        ("/rollouts/r2/messages", MESSAGES, "r2"),
        ("/v1/responses", RESPONSES, None),
        ("/rollouts/r3/v1/responses", RESPONSES, "r3"),
        ("/rollouts/r4/responses", RESPONSES, "r4"),
    ],
)
def test_each_route_records_into_its_rollout(
    make_app: MakeApp, path: str, body: dict[str, Any], rollout: str | None
) -> None:
    h = make_app()
    with TestClient(h.app) as client:
        resp = client.post(path, json=body)
        assert resp.status_code == 200, resp.text
        if rollout is not None:
            assert resp.headers["X-Turnstile-Rollout"] == rollout
    (turn,) = h.sink.turns
    assert rollout is None or turn.rollout_id == rollout


def test_the_rollout_header_groups_a_top_level_call(make_app: MakeApp) -> None:
    h = make_app()
    with TestClient(h.app) as client:
        resp = client.post("/v1/messages", json=MESSAGES, headers={"X-Turnstile-Rollout": "hdr"})
        assert resp.status_code == 200
    assert [t.rollout_id for t in h.sink.turns] == ["hdr"]


def test_other_methods_are_405_in_the_protocols_shape(make_app: MakeApp) -> None:
    h = make_app()
    with TestClient(h.app) as client:
        resp = client.get("/v1/messages")
        assert resp.status_code == 405 and resp.json()["type"] == "error"
        resp = client.get("/rollouts/r/responses")
        assert resp.status_code == 405 and resp.json()["error"]["type"] == "invalid_request_error"
    assert h.sink.turns == []


def test_a_websocket_upgrade_of_responses_is_426_at_once(make_app: MakeApp) -> None:
    h = make_app()
    with TestClient(h.app) as client:
        with (
            pytest.raises(WebSocketDenialResponse) as denied,
            client.websocket_connect("/v1/responses"),
        ):
            pass
        assert denied.value.status_code == 426
        upgrade = {"Upgrade": "websocket", "Connection": "Upgrade"}
        resp = client.get("/rollouts/r/v1/responses", headers=upgrade)
        assert resp.status_code == 426
        assert resp.json()["error"]["code"] == "websocket_not_supported"


def test_a_websocket_upgrade_over_a_real_server_is_an_http_426(
    make_app: MakeApp, live: Callable[[FastAPI], LiveServer]
) -> None:
    server = live(make_app().app)
    handshake = {
        "Upgrade": "websocket",
        "Connection": "Upgrade",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version": "13",
    }
    started = time.monotonic()
    resp = httpx.get(f"{server.url}/v1/responses", headers=handshake, timeout=10)
    assert resp.status_code == 426
    assert time.monotonic() - started < 5


@pytest.fixture
def keyed(make_app: MakeApp, monkeypatch: pytest.MonkeyPatch) -> MakeApp:
    monkeypatch.setenv("TS_KEY", KEY)

    def _make(**kw: Any) -> Any:
        return make_app(api_key_env=["TS_KEY"], **kw)

    return _make


def test_anthropic_x_api_key_is_a_client_key(keyed: MakeApp) -> None:
    h = keyed()
    with TestClient(h.app) as http:
        client = anthropic.Anthropic(
            base_url=str(http.base_url), api_key=KEY, http_client=http, max_retries=0
        )
        message = client.messages.create(**MESSAGES)
        assert message.content[0].text == "hello"
        resp = http.post("/v1/messages", json=MESSAGES, headers={"x-api-key": "wrong"})
        assert resp.status_code == 401
        resp = http.post("/v1/responses", json=RESPONSES, headers={"x-api-key": KEY})
        assert resp.status_code == 200
    assert len(h.sink.turns) == 2


def test_a_rollout_key_opens_its_rollouts_protocol_routes_only(keyed: MakeApp) -> None:
    h = keyed()
    with TestClient(h.app) as http:
        created = http.post("/rollouts", json={}, headers={"Authorization": f"Bearer {KEY}"})
        rid, key = created.json()["rollout_id"], created.json()["api_key"]
        for path in (f"/rollouts/{rid}/messages", f"/rollouts/{rid}/v1/messages"):
            resp = http.post(path, json=MESSAGES, headers={"x-api-key": key})
            assert resp.status_code == 200, resp.text
        resp = http.post(f"/rollouts/{rid}/responses", json=RESPONSES, headers={"x-api-key": key})
        assert resp.status_code == 200
        resp = http.post("/rollouts/other/messages", json=MESSAGES, headers={"x-api-key": key})
        assert resp.status_code == 403
    assert len(h.sink.turns) == 3


def test_the_first_delta_reaches_the_client_before_the_backends_last_token(
    make_app: MakeApp, live: Callable[[FastAPI], LiveServer]
) -> None:
    h = make_app(lambda body: Reply(text="abcdefghijklmnop", event_delay_s=0.05))
    server = live(h.app)

    def backend_progress() -> tuple[int, int]:
        resp = h.backend.responses[-1]
        return resp.sent, len(resp.body)

    anth = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0)
    with anth.messages.stream(**MESSAGES) as stream:
        first = next(iter(stream.text_stream))
        sent, total = backend_progress()
    assert first == "a" and sent < total - 5

    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k", max_retries=0)
    delta = None
    with oai.responses.stream(**RESPONSES) as events:
        for event in events:
            if event.type == "response.output_text.delta":
                delta, (sent, total) = event.delta, backend_progress()
                break
    assert delta == "a" and sent < total - 5


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/messages", {**MESSAGES, "stream": True}),
        ("/v1/responses", {**RESPONSES, "stream": True}),
    ],
)
def test_a_client_leaving_mid_stream_cancels_the_call(
    make_app: MakeApp, live: Callable[[FastAPI], LiveServer], path: str, body: Any
) -> None:
    h = make_app(lambda body: Reply(text="abcdefghijklmnopqrstuvwxyz", event_delay_s=0.05))
    server = live(h.app)
    with httpx.stream("POST", server.url + path, json=body, timeout=10) as resp:
        first = next(resp.iter_bytes())
        assert first.startswith(b"event: ")
    deadline = time.monotonic() + 10
    while h.app.state.proxy.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert h.app.state.proxy.in_flight == 0
    backend = h.backend.responses[-1]
    assert backend.closed and backend.sent < len(backend.body)
    server.stop()
    (turn,) = h.sink.turns
    assert turn.status.value == "aborted" and turn.http_status == 499
