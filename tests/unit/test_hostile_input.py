"""Hostile and careless values are refused where they enter, in the OpenAI error shape, and
cost nobody else's data: every earlier acknowledged turn is still recorded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.testclient import TestClient

from tests.fakes_sink import InMemorySink
from tests.unit.conftest import MakeApp
from turnstile.backends import fake
from turnstile.backends.fake import FakeResponse, FakeVLLM
from turnstile.errors import Overloaded, RequestTimeout
from turnstile.server.app import create_app
from turnstile.server.asgi import BodyReader
from turnstile.server.bodies import first_invalid_text
from turnstile.settings import load_settings

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
POLICY = "X-Turnstile-Policy-Version"


def _record_rollouts(client: TestClient, count: int) -> None:
    for i in range(count):
        assert client.post(f"/rollouts/good-{i}/v1/chat/completions", json=BODY).status_code == 200
        assert client.post(f"/rollouts/good-{i}/finish").status_code == 200


def _assert_error(resp: Any, status: int, needle: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert needle.lower() in error["message"].lower()
    assert error["type"]


@pytest.mark.parametrize(
    "value",
    [
        "9223372036854775808",  # 2**63: one past int64
        "-9223372036854775809",
        "1" + "0" * 30,  # 10**30: made the journal frame undecodable
        "+1",
        " 1",
        "1_000",
        "0x10",
        "1.0",
        "",
    ],
)
def test_an_out_of_range_policy_header_is_refused_and_costs_nobody_data(
    make_app: MakeApp, value: str
) -> None:
    h = make_app()
    with TestClient(h.app) as client:
        _record_rollouts(client, 5)
        resp = client.post("/rollouts/bad/v1/chat/completions", json=BODY, headers={POLICY: value})
        _assert_error(resp, 400, POLICY)
        assert client.get("/health").json()["status"] == "ok"
        # The refused call reached neither the backend nor the journal.
        calls = [r for r in h.backend.requests if r[1] == "/v1/chat/completions"]
        assert len(calls) == 5
    recorded = {t.rollout_id for t in h.sink.turns}
    assert recorded == {f"good-{i}" for i in range(5)}
    assert {r.rollout_id for r in h.sink.rollouts} == recorded


@pytest.mark.parametrize("value", ["9223372036854775807", "-9223372036854775808", "0", "7"])
def test_policy_headers_within_int64_are_recorded(make_app: MakeApp, value: str) -> None:
    h = make_app()
    with TestClient(h.app) as client:
        resp = client.post("/rollouts/r/v1/chat/completions", json=BODY, headers={POLICY: value})
        assert resp.status_code == 200, resp.text
    assert [t.policy_version for t in h.sink.turns] == [int(value)]


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, "5", True, 1.5])
def test_the_admin_policy_version_is_a_strict_int64(make_app: MakeApp, value: Any) -> None:
    with TestClient(make_app().app) as client:
        resp = client.post("/admin/policy_version", json={"policy_version": value})
        _assert_error(resp, 422, "policy_version")
        assert client.get("/admin/policy_version").json() == {"policy_version": 0}


def test_a_rollout_id_with_a_trailing_newline_is_refused(make_app: MakeApp) -> None:
    h = make_app()
    with TestClient(h.app) as client:
        resp = client.post("/rollouts/r1%0A/v1/chat/completions", json=BODY)
        _assert_error(resp, 400, "invalid rollout id")
        resp = client.post("/rollouts", json={"rollout_id": "r1\n"})
        _assert_error(resp, 400, "invalid rollout id")
        assert client.get("/rollouts/r1%0A").status_code == 400
    assert [r for r in h.backend.requests if r[0] == "POST"] == [] and h.sink.turns == []


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/rollouts", b'{"group_id": "\\ud800"}'),
        ("/rollouts", b'{"task_id": "a\\udfffb"}'),
        ("/rollouts", b'{"metadata": {"k": ["ok", {"deep": "\\ud83d"}]}}'),
        ("/rollouts", b'{"metadata": {"\\ud800": 1}}'),
        ("/rollouts/r/rewards", b'{"rewards": {"\\ud800": 1.0}}'),
        ("/rollouts/r/rewards", b'{"rewards": {"a": 1.0}, "info": {"a": "\\udc00"}}'),
        ("/rollouts/r/finish", b'{"rewards": {"a": 1.0}, "info": {"a": {"x": "\\ud800"}}}'),
    ],
)
def test_a_lone_surrogate_is_a_422_not_a_500(make_app: MakeApp, path: str, body: bytes) -> None:
    h = make_app()
    with TestClient(h.app) as client:
        assert client.post("/rollouts", json={"rollout_id": "r"}).status_code == 201
        resp = client.post(path, content=body, headers={"content-type": "application/json"})
        _assert_error(resp, 422, "valid UTF-8")
        # The rollout is untouched and can still be rewarded and finished.
        assert client.get("/rollouts/r").json()["rewards"] == {}
        assert client.post("/rollouts/r/finish", json={"rewards": {"a": 1.0}}).status_code == 200
    assert [r.rollout_id for r in h.sink.rollouts] == ["r"]


@pytest.mark.parametrize(
    "raw",
    [b'{"rewards": {"a": NaN}}', b'{"rewards": {"a": Infinity}}', b'{"rewards": {"a": 1e999}}'],
)
def test_non_finite_rewards_are_refused(make_app: MakeApp, raw: bytes) -> None:
    with TestClient(make_app().app) as client:
        client.post("/rollouts", json={"rollout_id": "r"})
        resp = client.post(
            "/rollouts/r/rewards", content=raw, headers={"content-type": "application/json"}
        )
        _assert_error(resp, 422, "rewards.a")


@pytest.mark.parametrize("value", [True, "1.5", None, [1.0], {"v": 1.0}])
def test_rewards_are_json_numbers_not_coerced(make_app: MakeApp, value: Any) -> None:
    with TestClient(make_app().app) as client:
        client.post("/rollouts", json={"rollout_id": "r"})
        _assert_error(client.post("/rollouts/r/rewards", json={"rewards": {"a": value}}), 422, "a")
        _assert_error(client.post("/rollouts/r/finish", json={"rewards": {"a": value}}), 422, "a")
        assert client.get("/rollouts/r").json()["status"] == "open"


def test_integer_rewards_are_numbers(make_app: MakeApp) -> None:
    with TestClient(make_app().app) as client:
        client.post("/rollouts", json={"rollout_id": "r"})
        resp = client.post("/rollouts/r/rewards", json={"rewards": {"a": 1, "b": -0.5}})
        assert resp.status_code == 200, resp.text


def test_head_health_answers_like_get(make_app: MakeApp) -> None:
    with TestClient(make_app().app) as client:
        head = client.head("/health")
        assert head.status_code == 200 and head.content == b""
        assert client.get("/health").status_code == 200


def test_first_invalid_text_names_the_path() -> None:
    assert first_invalid_text({"a": ["x", {"b": "\ud800"}]}) == (
        ".a[1].b: text must be valid UTF-8 (no lone surrogates)"
    )
    assert first_invalid_text({"a": ["x", {"b": "ok"}]}) is None
    assert first_invalid_text("\udfff") == ".: text must be valid UTF-8 (no lone surrogates)"
    assert "nested deeper than 255 levels" in (first_invalid_text(_nested(300)) or "")
    assert first_invalid_text(_nested(200)) is None


def _nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = {"k": [value]} if depth % 2 else [value]
    return value


@pytest.mark.parametrize("depth", [256, 300, 500, 1000])
@pytest.mark.parametrize("where", ["tools", "content", "metadata"])
def test_json_too_deep_to_record_is_a_422_and_the_rollout_stays_usable(
    make_app: MakeApp, depth: int, where: str
) -> None:
    h = make_app()
    deep = "__deep__"  # spliced in as text: the stdlib cannot write JSON this deep
    nested = "[" * depth + '"leaf"' + "]" * depth
    with TestClient(h.app) as client:
        assert client.post("/rollouts", json={"rollout_id": "r"}).status_code == 201
        if where == "metadata":
            raw = json.dumps({"rollout_id": "r2", "metadata": {"k": deep}})
            raw = raw.replace('"__deep__"', nested)
            resp = client.post(
                "/rollouts", content=raw, headers={"content-type": "application/json"}
            )
        else:
            body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            if where == "tools":
                function = {"name": "f", "parameters": {"type": "object", "x": deep}}
                body["tools"] = [{"type": "function", "function": function}]
            else:
                body["messages"] = [{"role": "user", "content": [{"type": "text", "text": deep}]}]
            raw = json.dumps(body).replace('"__deep__"', nested)
            resp = client.post(
                "/rollouts/r/v1/chat/completions",
                content=raw,
                headers={"content-type": "application/json"},
            )
        assert resp.status_code in (400, 422), resp.text
        assert resp.json()["error"]["message"]
        state = client.get("/rollouts/r").json()
        assert state["in_flight"] == 0 and state["num_turns"] == 0
        ok = client.post("/rollouts/r/v1/chat/completions", json=BODY)
        assert ok.status_code == 200
        assert client.post("/rollouts/r/finish").status_code == 200
    assert [t.rollout_id for t in h.sink.turns] == ["r"]


KEY, ADMIN = "client-key-123", "admin-key-789"


@pytest.mark.parametrize("separate_admin", [True, False])
def test_a_rollout_key_cannot_grade_its_own_rollout_through_finish(
    make_app: MakeApp, monkeypatch: pytest.MonkeyPatch, separate_admin: bool
) -> None:
    monkeypatch.setenv("TS_KEY", KEY)
    monkeypatch.setenv("TS_ADMIN", ADMIN)
    h = make_app(api_key_env=["TS_KEY"], admin_api_key_env="TS_ADMIN" if separate_admin else None)
    client_auth = {"Authorization": f"Bearer {KEY}"}
    rewarder = {"Authorization": f"Bearer {ADMIN if separate_admin else KEY}"}
    with TestClient(h.app) as client:
        minted = client.post("/rollouts", json={"rollout_id": "own"}, headers=client_auth).json()
        own = {"Authorization": f"Bearer {minted['api_key']}"}
        for body in ({"rewards": {"self": 9.0}}, {"info": {"self": "I did great"}}):
            resp = client.post("/rollouts/own/finish", json=body, headers=own)
            _assert_error(resp, 403, "rewards need the key")
        if separate_admin:  # the client key cannot grade either while an admin key is set
            resp = client.post(
                "/rollouts/own/finish", json={"rewards": {"x": 1.0}}, headers=client_auth
            )
            _assert_error(resp, 403, "rewards need the key")
        state = client.get("/rollouts/own", headers=client_auth).json()
        assert state["status"] == "open" and state["rewards"] == {}
        # finish without rewards stays open to the rollout key; the rewarder's rewards count
        ok = client.post("/rollouts/own/finish", json={"rewards": {"v": 1.0}}, headers=rewarder)
        assert ok.status_code == 200 and ok.json()["rewards"]["v"]["value"] == 1.0
        two = client.post("/rollouts", json={"rollout_id": "t"}, headers=client_auth).json()
        plain = client.post(
            "/rollouts/t/finish", headers={"Authorization": f"Bearer {two['api_key']}"}
        )
        assert plain.status_code == 200 and plain.json()["status"] == "finished"
    assert {r.rollout_id: r.status.value for r in h.sink.rollouts} == {
        "own": "finished",
        "t": "finished",
    }


# -- values from the backend ---------------------------------------------------------------


# JSON as a careless backend may write it: integers past 64 bits, numbers past a double.
_HUGE = "__huge_number__"


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj).replace(f'"{_HUGE}"', "1e999").encode()


class BadValueVLLM:
    """Answers every chat call with one vLLM-shaped answer whose values a test chose;
    calls of other rollouts get a good answer."""

    base_url = "http://bad-value-vllm"

    def __init__(self) -> None:
        self.token_ids: Any = [5, 6]
        self.prompt_ids: Any = [1, 2, 3]
        self.index: Any = 0
        self.logprob: Any = -0.5
        self.top_token = "token_id:7"

    def _values(self, good: bool) -> tuple[Any, Any, Any, Any, str]:
        if good:
            return [5, 6], [1, 2, 3], 0, -0.5, "token_id:7"
        return self.token_ids, self.prompt_ids, self.index, self.logprob, self.top_token

    async def request(
        self, method: str, path: str, body: bytes | None, headers: Any
    ) -> FakeResponse:
        json_head = {"Content-Type": "application/json"}
        if path != "/v1/chat/completions" or body is None:
            return FakeResponse(200, json_head, [b'{"object": "list", "data": []}'])
        request = orjson.loads(body)
        good = request["messages"][0]["content"] == "good"
        ids, prompt, index, lp, top = self._values(good)
        entries = [fake.logprob_entry(f"token_id:{i}", lp, [(top, lp)]) for i in range(2)]
        if request.get("stream"):
            chunks = [
                fake.chat_role_chunk("c", "m", 1, prompt),
                fake.chat_token_chunk("c", "m", index, "ab", entries[0], None, "stop"),
            ]
            chunks[1]["choices"][0]["token_ids"] = ids
            events = [b"data: " + _dumps(c) + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]
            return FakeResponse(200, {"Content-Type": "text/event-stream"}, events)
        choice = fake.chat_choice(index, fake.chat_message("ab"), entries, "stop", ids)
        answer = fake.chat_completion("c", "m", [choice], fake.usage(3, 2), prompt)
        return FakeResponse(200, json_head, [_dumps(answer)])

    async def aclose(self) -> None:
        return None


BAD_VALUES: list[tuple[str, Any]] = [
    ("token_ids", [5, 2**31]),
    ("token_ids", [5, -1]),
    ("token_ids", [5, 2**40]),
    ("token_ids", [5, 2**70]),
    ("token_ids", ["5", 6]),
    ("token_ids", [5, None]),
    ("token_ids", [5, 1.5]),
    ("token_ids", "56"),
    ("prompt_ids", [1, 2**31]),
    ("prompt_ids", [-3]),
    ("index", 2**40),
    ("index", -1),
    ("index", "0"),
    ("logprob", _HUGE),
    ("top_token", "token_id:99999999999"),
]


@pytest.mark.parametrize(
    ("stream", "client_asks"),
    # client_asks: the client wants ids and logprobs itself, so the answer is relayed as
    # is and decoded sparsely (turnstile.proxy.sparse); else it is decoded whole.
    [(False, False), (False, True), (True, False)],
)
@pytest.mark.parametrize(("field_name", "value"), BAD_VALUES)
def test_an_unrecordable_backend_value_is_an_error_turn_and_a_502(
    tmp_path: Path, stream: bool, client_asks: bool, field_name: str, value: Any
) -> None:
    backend = BadValueVLLM()
    setattr(backend, field_name, value)
    sink = InMemorySink()
    settings = load_settings(None, {"output": tmp_path / "out", "top_logprobs": 1}, environ={})
    good: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "good"}],
        "stream": stream,
    }
    if client_asks:
        good |= {"return_token_ids": True, "logprobs": True, "top_logprobs": 1}
    bad = {**good, "messages": [{"role": "user", "content": "bad"}]}
    with TestClient(create_app(settings, backend=backend, sink=sink)) as client:
        for i in range(3):
            assert (
                client.post(f"/rollouts/ok-{i}/v1/chat/completions", json=good).status_code == 200
            )
        resp = client.post("/rollouts/bad/v1/chat/completions", json=bad)
        # Top-k alternatives are recorded as ids only when Turnstile asked for them as ids;
        # a client asking for its own top_logprobs gets them as text, and nothing is parsed.
        unparsed = client_asks and field_name == "top_token"
        if unparsed:
            assert resp.status_code == 200
        elif stream:  # the status went out with the first byte: an error event, then [DONE]
            assert resp.status_code == 200
            assert '"backend_error"' in resp.text and resp.text.rstrip().endswith("[DONE]")
        else:
            _assert_error(resp, 502, "the backend")
        state = client.get("/rollouts/bad").json()
        assert state["in_flight"] == 0 and state["num_turns"] == 1
        assert client.post("/rollouts/bad/finish").status_code == 200
        for i in range(3):
            client.post(f"/rollouts/ok-{i}/finish")
        assert client.get("/health").json()["status"] == "ok"
    turns = {t.rollout_id: t for t in sink.turns}
    assert sorted(turns) == ["bad", "ok-0", "ok-1", "ok-2"]
    if unparsed:
        assert turns["bad"].status.value == "ok" and turns["bad"].top_logprob_ids is None
    else:
        assert turns["bad"].status.value == "error"
        assert turns["bad"].error and "the backend" in turns["bad"].error
    assert all(turns[f"ok-{i}"].status.value == "ok" for i in range(3))
    assert list(turns["ok-0"].completion_token_ids) == [5, 6]
    assert {r.rollout_id for r in sink.rollouts} == set(turns)


# -- routes: passthrough stays under /v1/, completions are recorded or refused ----------------


def _raw_request(port: int, method: str, target: str, body: bytes = b"", auth: str = "") -> int:
    """Send `target` byte for byte (an HTTP client would normalise it); return the status."""
    head = f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    if auth:
        head += f"Authorization: Bearer {auth}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode() + body)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return int(reply.split(b" ", 2)[1])


ESCAPES = [
    ("POST", "/v1/../admin/policy_version", b'{"policy_version": 7}'),
    ("POST", "/v1/%2e%2e/admin/policy_version", b'{"policy_version": 7}'),
    ("POST", "/v1/%2E%2E/sleep", b"{}"),
    ("GET", "/v1/..%2F..%2Fetc%2Fpasswd", b""),
    ("GET", "/v1/models/..", b""),
    ("GET", "/v1//models", b""),
    ("GET", "/v1/a%5c..%5cb", b""),
]
MISSPELT = [
    "/v1/chat/completions/",
    "/v1/x/../chat/completions",
    "/v1/chat/./completions",
    "/v1//chat/completions",
    "/v1/completions/",
    "/v1/chat%2Fcompletions",
]


@pytest.mark.parametrize(("method", "target", "body"), ESCAPES)
def test_passthrough_never_leaves_v1(
    make_app: MakeApp, live: Any, method: str, target: str, body: bytes
) -> None:
    h = make_app()
    server = live(h.app)
    assert _raw_request(server.port, method, target, body) in (400, 404)
    forwarded = [path for _, path, _, _ in h.backend.requests if path != "/v1/models"]
    assert forwarded == []
    assert _raw_request(server.port, "GET", "/v1/models") == 200  # the plain path still works


@pytest.mark.parametrize("target", MISSPELT)
def test_a_completion_route_in_another_spelling_is_never_generated_unrecorded(
    make_app: MakeApp, live: Any, target: str
) -> None:
    h = make_app()
    server = live(h.app)
    status = _raw_request(server.port, "POST", target, orjson.dumps(BODY))
    generated = [r for r in h.backend.requests if r[1].endswith("completions")]
    if generated:  # the backend answered: then the turn must be recorded
        assert status == 200
        deadline = time.monotonic() + 10  # the writer thread takes it off the request path
        while len(h.sink.turns) + len(h.sink.pending_turns) < len(generated):
            assert time.monotonic() < deadline, "a generated turn was not recorded"
            time.sleep(0.02)
    else:
        assert status in (400, 404)


def test_a_rollout_key_opens_no_passthrough(
    make_app: MakeApp, live: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TS_KEY", KEY)
    h = make_app(api_key_env=["TS_KEY"])
    with TestClient(h.app) as client:
        minted = client.post(
            "/rollouts", json={"rollout_id": "own"}, headers={"Authorization": f"Bearer {KEY}"}
        ).json()
        own = {"Authorization": f"Bearer {minted['api_key']}", "X-Turnstile-Rollout": "own"}
        for method, path in [
            ("GET", "/v1/models"),
            ("POST", "/v1/load_lora_adapter"),
            ("POST", "/v1/embeddings"),
            ("GET", "/rollouts/own/v1/models"),
            ("POST", "/tokenize"),
        ]:
            resp = client.request(method, path, headers=own, json={})
            assert resp.status_code in (403, 404), (method, path, resp.status_code)
        # what it is for still works
        assert client.post("/rollouts/own/v1/chat/completions", json=BODY, headers=own).is_success
        assert client.post("/v1/chat/completions", json=BODY, headers=own).is_success
        assert client.get("/rollouts/own", headers=own).json()["num_turns"] == 2
    posts = [path for method, path, _, _ in h.backend.requests if method == "POST"]
    assert posts == ["/v1/chat/completions", "/v1/chat/completions"]


# -- files and content types -----------------------------------------------------------------


def test_shards_manifests_and_journal_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    out = tmp_path / "out"
    settings = load_settings(None, {"output": out, "shard_max_rows": 1}, environ={})
    with TestClient(create_app(settings, backend=FakeVLLM())) as client:
        assert client.post("/rollouts/r/v1/chat/completions", json=BODY).status_code == 200
        journal = [p for p in (out / "journal").rglob("*") if p.is_file()]
        assert journal, "the journal holds the acknowledged turn"
        assert {p.stat().st_mode & 0o777 for p in journal} == {0o600}
        client.post("/rollouts/r/finish")
    written = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.suffix == ".parquet" for p in written)
    assert any(p.suffix == ".json" for p in written)  # the writer's manifest
    modes = {str(p.relative_to(out)): p.stat().st_mode & 0o777 for p in written}
    assert set(modes.values()) == {0o600}, modes


class HtmlStreamVLLM:
    """Answers a streamed call with SSE events but `Content-Type: text/html` (as a proxy
    or load balancer in front of the backend may), and an error event in the stream."""

    base_url = "http://html-stream"

    async def request(self, method: str, path: str, body: bytes | None, headers: Any) -> Any:
        if path != "/v1/chat/completions":
            return FakeResponse(200, {"Content-Type": "application/json"}, [b'{"data": []}'])
        events = [b'data: {"error": {"message": "engine overloaded", "code": 503}}\n\n']
        return FakeResponse(200, {"Content-Type": "text/html; charset=utf-8"}, events)

    async def aclose(self) -> None:
        return None


def test_a_relayed_stream_is_always_sse(tmp_path: Path) -> None:
    settings = load_settings(None, {"output": tmp_path / "out"}, environ={})
    sink = InMemorySink()
    with TestClient(create_app(settings, backend=HtmlStreamVLLM(), sink=sink)) as client:
        resp = client.post("/rollouts/r/v1/chat/completions", json={**BODY, "stream": True})
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert "engine overloaded" in resp.text and resp.text.rstrip().endswith("[DONE]")
        assert client.get("/rollouts/r").json()["in_flight"] == 0
        client.post("/rollouts/r/finish")
    assert [t.status.value for t in sink.turns] == ["error"]


# -- a bounded server -------------------------------------------------------------------------


def test_too_many_or_too_large_headers_get_431(make_app: MakeApp, live: Any) -> None:
    h = make_app()
    server = live(h.app)
    many = {f"x-h{i}": "1" for i in range(150)}
    with httpx.Client(base_url=server.url, timeout=10) as client:
        resp = client.post("/rollouts/r/v1/chat/completions", json=BODY, headers=many)
        _assert_error(resp, 431, "request headers")
        big = {"x-big": "a" * (70 * 1024)}
        _assert_error(client.get("/health", headers=big), 431, "bytes of request headers")
        assert client.post("/rollouts/r/v1/chat/completions", json=BODY).status_code == 200
    assert len([r for r in h.backend.requests if r[0] == "POST"]) == 1


def _receive_from(chunks: list[bytes], then_wait: bool) -> Any:
    """An ASGI receive that delivers `chunks` (more to come), then waits for ever or ends."""
    queue = list(chunks)

    async def receive() -> dict[str, Any]:
        if queue:
            return {"type": "http.request", "body": queue.pop(0), "more_body": True}
        if then_wait:
            await asyncio.sleep(3600)
        return {"type": "http.request", "body": b"", "more_body": False}

    return receive


async def test_a_body_that_does_not_arrive_in_time_gets_408() -> None:
    reader = BodyReader(1024, timeout_s=0.2)
    with pytest.raises(RequestTimeout, match=r"did not arrive within 0\.2 s"):
        await reader.read(_receive_from([b"{"], then_wait=True), b"100")
    assert reader.buffered == 0  # what it held is given back


async def test_bodies_buffered_together_are_bounded() -> None:
    reader = BodyReader(100, budget=150, timeout_s=5)
    slow = asyncio.ensure_future(reader.read(_receive_from([b"x" * 100], then_wait=True), None))
    await asyncio.sleep(0.05)
    assert reader.buffered == 100
    with pytest.raises(Overloaded) as refused:
        await reader.read(_receive_from([b"y" * 100], then_wait=False), None)
    assert refused.value.status == 503 and "Retry-After" in refused.value.headers()
    slow.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await slow
    assert reader.buffered == 0
    assert await reader.read(_receive_from([b"z" * 100], then_wait=False), None) == b"z" * 100


class SlowVLLM:
    """Takes 30 s to answer a chat call, unless the call is cancelled first."""

    base_url = "http://slow-vllm"

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    async def request(self, method: str, path: str, body: bytes | None, headers: Any) -> Any:
        if path != "/v1/chat/completions":
            return FakeResponse(200, {"Content-Type": "application/json"}, [b'{"data": []}'])
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        raise AssertionError("the call was not cancelled")

    async def aclose(self) -> None:
        return None


def test_a_non_streaming_client_that_leaves_cancels_the_call(tmp_path: Path, live: Any) -> None:
    backend = SlowVLLM()
    sink = InMemorySink()
    settings = load_settings(None, {"output": tmp_path / "out"}, environ={})
    app = create_app(settings, backend=backend, sink=sink)
    server = live(app)
    body = orjson.dumps(BODY)
    head = (
        f"POST /rollouts/r/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head.encode() + body)
        time.sleep(0.5)  # the call is with the backend now
    deadline = time.monotonic() + 10
    with httpx.Client(base_url=server.url, timeout=10) as client:
        while client.get("/rollouts/r").json()["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.05)
        state = client.get("/rollouts/r").json()
        assert state["in_flight"] == 0 and state["num_turns"] == 1
        assert client.post("/rollouts/r/finish").status_code == 200
    server.__exit__()
    assert backend.cancelled.is_set()  # the upstream request was closed, not left running
    assert [(t.status.value, t.http_status) for t in sink.turns] == [("aborted", 499)]
