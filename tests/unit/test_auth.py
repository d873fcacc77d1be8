"""Authentication: every route but /health is guarded, keys never leak, admin split."""

from __future__ import annotations

import logging
import re

import pytest
from starlette.testclient import TestClient

from tests.unit.conftest import MakeApp
from turnstile.settings import SettingsError, load_settings

KEY, OTHER, ADMIN = "client-key-123", "client-key-456", "admin-key-789"


@pytest.fixture
def keyed(make_app: MakeApp, monkeypatch: pytest.MonkeyPatch) -> MakeApp:
    monkeypatch.setenv("TS_KEY_A", KEY)
    monkeypatch.setenv("TS_KEY_B", OTHER)
    monkeypatch.setenv("TS_ADMIN", ADMIN)

    def _make(**kw: object) -> object:
        return make_app(api_key_env=["TS_KEY_A", "TS_KEY_B"], admin_api_key_env="TS_ADMIN", **kw)

    return _make  # type: ignore[return-value]


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x1", path)


def test_every_route_but_health_needs_a_key(keyed: MakeApp) -> None:
    h = keyed()
    routes = [r for r in h.app.routes if getattr(r, "methods", None)]
    assert len(routes) > 10
    seen = 0
    with TestClient(h.app) as client:
        for route in routes:
            for method in sorted(route.methods):  # type: ignore[attr-defined]
                if method == "HEAD":
                    continue
                path = _concrete(route.path)  # type: ignore[attr-defined]
                resp = client.request(method, path, json={})
                if path == "/health":
                    assert resp.status_code == 200
                    continue
                seen += 1
                assert resp.status_code == 401, (method, path, resp.status_code)
                body = resp.text
                assert KEY not in body and OTHER not in body and ADMIN not in body
                assert resp.json()["error"]["type"] == "authentication_error"
                wrong = client.request(
                    method, path, json={}, headers={"Authorization": "Bearer nope"}
                )
                assert wrong.status_code == 401
    assert seen > 10
    assert h.backend.requests[1:] == []  # nothing unauthenticated reached the backend


def test_keys_open_their_routes_only(keyed: MakeApp, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    h = keyed()
    client_auth = {"Authorization": f"Bearer {OTHER}"}
    admin_auth = {"Authorization": f"Bearer {ADMIN}"}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    steering = {
        "Connection": "keep-alive, X-Secret",
        "X-Secret": "1",
        "Host": "evil.example",
        "X-Forwarded-Host": "evil.example",
        "Proxy-Authorization": "Basic eA==",
        "TE": "trailers",
        "Upgrade": "h2c",
    }
    with TestClient(h.app) as client:
        resp = client.post("/v1/chat/completions", json=body, headers={**client_auth, **steering})
        assert resp.status_code == 200
        # neither the client's key nor any hop-by-hop or steering header reaches the backend
        calls = [r for r in h.backend.requests if r[1].endswith("/completions")]
        ((_, path, _, sent_headers),) = calls
        assert path == "/v1/chat/completions"
        assert sent_headers == {"Content-Type": "application/json"}
        assert (
            client.post("/rollouts", json={"rollout_id": "r"}, headers=client_auth).status_code
            == 201
        )
        rewards = {"rewards": {"ok": 1.0}}
        assert (
            client.post("/rollouts/r/rewards", json=rewards, headers=client_auth).status_code == 401
        )
        assert (
            client.post("/rollouts/r/rewards", json=rewards, headers=admin_auth).status_code == 200
        )
        assert (
            client.post(
                "/admin/policy_version", json={"policy_version": 1}, headers=client_auth
            ).status_code
            == 401
        )
        assert (
            client.post(
                "/admin/policy_version", json={"policy_version": 1}, headers=admin_auth
            ).status_code
            == 200
        )
    assert KEY not in caplog.text and OTHER not in caplog.text and ADMIN not in caplog.text
    for turn in h.sink.turns:
        assert OTHER not in repr(turn)


def test_refuses_open_non_loopback_bind_and_empty_keys(
    monkeypatch: pytest.MonkeyPatch, make_app: MakeApp
) -> None:
    with pytest.raises(SettingsError, match=r"refusing to bind 0\.0\.0\.0"):
        load_settings(None, {"host": "0.0.0.0"}, environ={})
    assert load_settings(None, {"host": "::1"}, environ={}).host == "::1"
    monkeypatch.setenv("TS_EMPTY", "")
    with pytest.raises(SettingsError, match="empty"):
        make_app(api_key_env=["TS_EMPTY"])


@pytest.mark.parametrize("separate_admin", [True, False])
def test_rollout_keys_open_their_own_rollout_only(
    make_app: MakeApp, monkeypatch: pytest.MonkeyPatch, separate_admin: bool
) -> None:
    monkeypatch.setenv("TS_KEY_A", KEY)
    monkeypatch.setenv("TS_ADMIN", ADMIN)
    h = make_app(api_key_env=["TS_KEY_A"], admin_api_key_env="TS_ADMIN" if separate_admin else None)
    client_auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(h.app) as client:
        mine = client.post("/rollouts", json={"rollout_id": "mine"}, headers=client_auth).json()
        client.post("/rollouts", json={"rollout_id": "theirs"}, headers=client_auth)
        key = mine["api_key"]
        assert key.startswith("tsr_mine.") and KEY not in key
        auth = {"Authorization": f"Bearer {key}"}
        # its own rollout: chat under the rollout path, via the header, state and finish
        assert (
            client.post("/rollouts/mine/v1/chat/completions", json=body, headers=auth).status_code
            == 200
        )
        assert (
            client.post(
                "/v1/chat/completions", json=body, headers={**auth, "X-Turnstile-Rollout": "mine"}
            ).status_code
            == 200
        )
        assert client.get("/rollouts/mine", headers=auth).json()["num_turns"] == 2
        # anything else: 403, and nothing reaches the backend or the rollout
        calls = len(h.backend.requests)
        refused = [
            client.post("/rollouts/theirs/v1/chat/completions", json=body, headers=auth),
            client.post(
                "/v1/chat/completions", json=body, headers={**auth, "X-Turnstile-Rollout": "theirs"}
            ),
            client.post("/v1/chat/completions", json=body, headers=auth),  # implicit rollout
            client.post("/rollouts/mine/rewards", json={"rewards": {"ok": 1.0}}, headers=auth),
            client.post("/rollouts/theirs/finish", headers=auth),
            client.post("/admin/policy_version", json={"policy_version": 3}, headers=auth),
            client.post("/rollouts", json={"rollout_id": "new"}, headers=auth),
            client.get("/stats", headers=auth),
            client.get("/v1/models", headers=auth),
        ]
        for resp in refused:
            assert resp.status_code == 403, (resp.request.url, resp.status_code)
            assert resp.json()["error"]["type"] == "permission_error"
        assert len(h.backend.requests) == calls
        assert client.get("/rollouts/theirs", headers=client_auth).json()["num_turns"] == 0
        # a forged or tampered key is simply invalid
        forged = "tsr_theirs." + key.rpartition(".")[2]
        assert (
            client.post(
                "/rollouts/theirs/finish", headers={"Authorization": f"Bearer {forged}"}
            ).status_code
            == 401
        )
        assert client.post("/rollouts/mine/finish", headers=auth).json()["status"] == "finished"
    # keys derive from the client keys: the same keys mint the same rollout key
    again = make_app(api_key_env=["TS_KEY_A"])
    with TestClient(again.app) as client:
        assert (
            client.post("/rollouts", json={"rollout_id": "mine"}, headers=client_auth).json()[
                "api_key"
            ]
            == key
        )


def test_no_rollout_key_without_client_keys(make_app: MakeApp) -> None:
    with TestClient(make_app().app) as client:
        assert client.post("/rollouts", json={"rollout_id": "r"}).json()["api_key"] is None
