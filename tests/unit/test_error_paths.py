"""Every error path of a completion call ends the call cleanly.

Turnstile is served on loopback in front of a scripted vLLM-shaped HTTP backend (the real
aiohttp client, real timeouts, a real journal and real shards), and each case below is
one way a call can fail: the client's fault (400, 413, 422, 401, 403, 409), the
backend's (refused connection, its own 4xx/5xx, timeouts before the first byte, between
chunks and in total, garbage, values no column can hold), the client leaving (whole and
streamed), and Turnstile's own (journal failure, recorder failure or backlog). For each:
the status the client gets (never Turnstile's own 500), `in_flight` back to 0, the
rollout still finishable, and, read from the published shards after shutdown, the turn
recorded with the right status and error text wherever a turn was begun.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pyarrow.parquet as pq
import pytest
from aiohttp import web
from starlette.testclient import TestClient

from tests.fakes_backend import FakeVLLM, Reply
from tests.live import LiveServer, aiohttp_server, free_port
from turnstile.reader import open_output
from turnstile.server.app import create_app
from turnstile.settings import load_settings

KEY = "error-paths-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Backend timeouts, small so that the walk is quick: every scripted stall outlasts them.
TIMEOUTS = {
    "connect_timeout_s": 1.0,
    "first_byte_timeout_s": 1.0,
    "idle_timeout_s": 1.0,
    "total_timeout_s": 2.0,
}
STALL_S = 3.0  # how long the scripted backend stalls: longer than any timeout above
MAX_BODY = 256 * 1024


def _script(body: dict[str, Any]) -> Reply:
    model = body.get("model")
    if model == "slow-stream":  # an event every 0.2 s for 12 s: the client leaves first
        return Reply(text="w " * 30, event_delay_s=0.2)
    if model == "total":  # never idle for long, but never done before the total timeout
        return Reply(text="w " * 40, event_delay_s=0.1)
    return Reply(text="fine answer")


@pytest.fixture
def backend_url() -> Iterator[str]:
    """The fake vLLM over real HTTP; the request's `model` picks a misbehaviour."""
    fake = FakeVLLM(_script)

    async def relay(
        request: web.Request, body: bytes, stall_after: int | None
    ) -> web.StreamResponse:
        resp = await fake.request(request.method, request.path, body or None, {})
        out = web.StreamResponse(status=resp.status, headers=dict(resp.headers))
        await out.prepare(request)
        try:
            async for n, chunk in _enumerate(resp.iter_chunks()):
                if stall_after is not None and n == stall_after:
                    await asyncio.sleep(STALL_S)
                    return out
                await out.write(chunk)
            await out.write_eof()
        except ConnectionError:
            resp.close()
        return out

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        model = json.loads(body).get("model") if body else None
        if model == "status-400":
            return web.json_response(
                {"object": "error", "message": "max_tokens is too large", "code": 400},
                status=400,
            )
        if model == "status-503":
            return web.json_response({"message": "the engine is overloaded"}, status=503)
        if model == "status-500":
            return web.Response(status=500, text="engine crashed")
        if model in ("first-byte", "slow"):
            await asyncio.sleep(STALL_S)
            return web.Response(status=200, text="{}")
        if model == "garbage":
            return web.Response(body=b"<html>502 bad gateway</html>", content_type="text/html")
        if model == "bad-token":
            answer = orjson.loads(await (await fake.request("POST", request.path, body, {})).read())
            answer["choices"][0]["token_ids"] = [2**40]
            return web.json_response(answer)
        if model == "bad-event":
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(b"data: {not json\n\n")
            await out.write_eof()
            return out
        if model == "bad-token-stream":
            resp = await fake.request("POST", request.path, body, {})
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            async for chunk in resp.iter_chunks():
                await out.write(chunk.replace(b'"token_ids":[', b'"token_ids":[-7,'))
            await out.write_eof()
            return out
        if model == "idle":  # a stream that stops after its first events
            return await relay(request, body, stall_after=2)
        if model == "idle-whole":  # a whole body that stops half-way
            whole = await (await fake.request("POST", request.path, body, {})).read()
            out = web.StreamResponse(
                headers={"Content-Type": "application/json", "Content-Length": str(len(whole))}
            )
            await out.prepare(request)
            await out.write(whole[: len(whole) // 2])
            await asyncio.sleep(STALL_S)
            return out
        return await relay(request, body, stall_after=None)

    with aiohttp_server(handle, shutdown_timeout_s=1.0) as url:
        yield url


async def _enumerate(chunks: Any) -> Any:
    n = 0
    async for chunk in chunks:
        yield n, chunk
        n += 1


@dataclass(frozen=True)
class Expected:
    """What a case must end in: the client's status, and the recorded turn (if begun)."""

    status: int | None  # None: the client left before any answer
    turn: str | None = None  # the recorded turn's status; None: no turn was begun
    http_status: int | None = None  # the recorded turn's http_status
    error: str | None = None  # a piece of the recorded turn's error text
    stream_error: str | None = None  # a 200 stream that ends in this error event


def _chat(model: str, *, stream: Any = False, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        **extra,
    }


def _post(
    client: httpx.Client, rid: str, body: Any = None, *, raw: bytes | None = None, **kw: Any
) -> httpx.Response:
    content = raw if raw is not None else orjson.dumps(body)
    headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
    return client.post(
        f"/rollouts/{rid}/v1/chat/completions", content=content, headers=headers, **kw
    )


def _leave(server: LiveServer, body: dict[str, Any], rid: str, after_bytes: int) -> None:
    """Send a call over a raw socket and close it once `after_bytes` of answer arrived."""
    data = orjson.dumps(body)
    head = (
        f"POST /rollouts/{rid}/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head.encode() + data)
        got = b""
        while len(got) < after_bytes:
            chunk = sock.recv(65536)
            assert chunk, "the server closed before the client could leave"
            got += chunk
        time.sleep(0.15)  # the call is with the backend now


def _wait(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not reached within {timeout_s} s: {what}"
        time.sleep(0.02)


class Walk:
    """The live app, and a record of what each case expects."""

    def __init__(self, server: LiveServer, client: httpx.Client) -> None:
        self.server = server
        self.client = client
        self.expected: dict[str, Expected] = {}

    def _stats(self) -> dict[str, Any]:
        resp = self.client.get("/stats")
        assert resp.status_code == 200, resp.text
        stats: dict[str, Any] = resp.json()
        return stats

    def check(self, rid: str, resp: httpx.Response | None, expected: Expected) -> None:
        """The client's answer, `in_flight` released, the rollout still finishable."""
        self.expected[rid] = expected
        if resp is not None:
            assert resp.status_code == expected.status, (rid, resp.status_code, resp.text)
            assert "internal error in Turnstile" not in resp.text, (rid, resp.text)
            if expected.stream_error is not None:
                events = [line[6:] for line in resp.text.split("\n") if line.startswith("data: ")]
                assert events[-1] == "[DONE]", (rid, events)
                error = orjson.loads(events[-2])["error"]["message"]
                assert expected.stream_error in error, (rid, error)
            elif expected.status != 200:
                assert resp.content, rid  # Turnstile's error, or the backend's own body
        _wait(lambda: self._stats()["in_flight"] == 0, f"{rid}: in_flight")
        state = self.client.get(f"/rollouts/{rid}")
        if expected.turn is None and state.status_code == 404:
            return  # refused before any rollout existed
        assert state.status_code == 200, (rid, state.text)
        assert state.json()["in_flight"] == 0, (rid, state.json())
        finished = self.client.post(f"/rollouts/{rid}/finish")
        assert finished.status_code == 200, (rid, finished.text)
        assert finished.json()["status"] == "finished"


def _walk_client_errors(walk: Walk) -> None:
    client = walk.client
    rid = "c-json"
    walk.check(rid, _post(client, rid, raw=b'{"model": "m", "messages": ['), Expected(400))
    rid = "c-large"
    big = _chat("ok", padding="x" * (MAX_BODY + 1))
    walk.check(rid, _post(client, rid, big), Expected(413))
    rid = "c-no-messages"
    walk.check(rid, _post(client, rid, {"model": "ok"}), Expected(422))
    rid = "c-wrong-types"
    walk.check(rid, _post(client, rid, _chat("ok", stream="yes")), Expected(422))
    rid = "c-deep"
    deep = b"[" * 300 + b'"x"' + b"]" * 300  # deeper than a JSON column can hold
    raw = b'{"model": "ok", "messages": [{"role": "user", "content": ' + deep + b"}]}"
    walk.check(rid, _post(client, rid, raw=raw), Expected(422))
    rid = "c-surrogate"
    raw = b'{"model": "ok", "messages": [{"role": "user", "content": "\\ud800"}]}'
    walk.check(rid, _post(client, rid, raw=raw), Expected(400))
    rid = "c-policy"
    resp = _post(client, rid, _chat("ok"), headers={"X-Turnstile-Policy-Version": str(2**63)})
    walk.check(rid, resp, Expected(400))
    resp = client.post("/rollouts/bad%0Aid/v1/chat/completions", json=_chat("ok"))
    assert resp.status_code == 400, resp.text
    rid = "c-401"
    resp = httpx.post(
        f"{walk.server.url}/rollouts/{rid}/v1/chat/completions", json=_chat("ok"), timeout=10
    )
    walk.check(rid, resp, Expected(401))
    rid = "c-403"
    other = client.post("/rollouts", json={"rollout_id": "c-403-other"}).json()["api_key"]
    resp = _post(client, rid, _chat("ok"), headers={"Authorization": f"Bearer {other}"})
    walk.check(rid, resp, Expected(403))
    walk.check("c-403-other", None, Expected(None))
    rid = "c-sealed"
    assert _post(client, rid, _chat("ok")).status_code == 200
    assert client.post(f"/rollouts/{rid}/finish").status_code == 200
    resp = _post(client, rid, _chat("ok"))
    assert resp.status_code == 409, resp.text
    walk.expected[rid] = Expected(200, "ok", 200)


def _walk_backend_errors(walk: Walk) -> None:
    client = walk.client
    cases = {
        "status-400": (False, Expected(400, "error", 400, "max_tokens is too large")),
        "status-503": (False, Expected(503, "error", 503, "overloaded")),
        # The backend's own 500 is relayed as it is (its body, not Turnstile's).
        "status-500": (False, Expected(500, "error", 500, "engine crashed")),
        "first-byte": (False, Expected(504, "error", 504, "did not answer within 1 s")),
        "idle-whole": (False, Expected(504, "error", 504, "idle timeout")),
        "idle": (True, Expected(200, "aborted", 502, "idle timeout", "idle timeout")),
        "total": (True, Expected(200, "aborted", 502, "total timeout", "total timeout")),
        "garbage": (False, Expected(502, "error", 502, "not a JSON object")),
        "bad-token": (False, Expected(502, "error", 502, "1099511627776")),
        "bad-token-stream": (True, Expected(200, "error", 502, "-7", "-7")),
        "bad-event": (True, Expected(200, "error", 502, "not JSON", "not JSON")),
    }
    for model, (stream, expected) in cases.items():
        rid = f"b-{model}"
        walk.check(rid, _post(client, rid, _chat(model, stream=stream)), expected)


def _walk_client_leaving(walk: Walk) -> None:
    rid = "d-whole"
    _leave(walk.server, _chat("slow"), rid, after_bytes=0)
    walk.check(rid, None, Expected(None, "aborted", 499, "cancelled"))
    rid = "d-stream"
    _leave(walk.server, _chat("slow-stream", stream=True), rid, after_bytes=1)
    walk.check(rid, None, Expected(None, "aborted", 499, "client disconnected"))


def _walk_turnstile_errors(walk: Walk, monkeypatch: pytest.MonkeyPatch) -> None:
    client = walk.client
    real_write = os.write

    def failing_write(fd: int, data: Any) -> int:
        if len(data) > 64:  # a journal frame: the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    rid = "t-journal"
    assert _post(client, rid, _chat("ok")).status_code == 200  # the rollout exists
    with monkeypatch.context() as patch:
        patch.setattr(os, "write", failing_write)
        resp = _post(client, rid, _chat("ok"))
    # Not acknowledged (the client retries), yet recorded: what the backend did is kept.
    walk.check(rid, resp, Expected(503, "ok", 200))
    assert "disk is full" in resp.json()["error"]["message"]
    _wait(lambda: client.get("/health").status_code == 200, "the journal works again")

    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    rid = "t-recorder"
    # Everything earlier is written first (a seal job caught by the full disk is the
    # subject of test_a_failed_sample_write_keeps_the_rollout_row below).
    _wait(lambda: client.get("/stats").json()["backlog"] == 0, "the writer is idle")
    with monkeypatch.context() as patch:
        patch.setattr(pq, "write_table", full_disk)
        assert _post(client, rid, _chat("ok")).status_code == 200
        _wait(lambda: client.get("/health").status_code == 503, "the recorder fails")
        resp = _post(client, rid, _chat("ok"))
    assert "No space left" in resp.json()["error"]["message"]
    _wait(lambda: client.get("/health").status_code == 200, "the recorder recovers")
    walk.check(rid, resp, Expected(503))
    walk.expected[rid] = Expected(503, "ok", 200)


def _app(
    output: Path, backends: list[str], monkeypatch: pytest.MonkeyPatch, **overrides: Any
) -> Any:
    monkeypatch.setenv("ERROR_PATHS_KEY", KEY)
    settings = load_settings(
        None,
        {
            "backends": backends,
            "output": output,
            "api_key_env": ["ERROR_PATHS_KEY"],
            "max_request_body_bytes": MAX_BODY,
            "shard_max_rows": 1,
            "shard_max_age_s": 0.2,
            **TIMEOUTS,
            **overrides,
        },
        environ={},
    )
    return create_app(settings)


def test_every_error_path_ends_the_call(
    backend_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    with (
        LiveServer(_app(out, [backend_url], monkeypatch)) as server,
        httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as client,
    ):
        walk = Walk(server, client)
        rid = "before"
        walk.check(rid, _post(client, rid, _chat("ok")), Expected(200, "ok", 200))
        _walk_client_errors(walk)
        _walk_backend_errors(walk)
        _walk_client_leaving(walk)
        _walk_turnstile_errors(walk, monkeypatch)
        rid = "after"
        walk.check(rid, _post(client, rid, _chat("ok", stream=True)), Expected(200, "ok", 200))
        assert client.get("/stats").json()["dropped"] == 0
    _check_recorded(out, walk.expected)


def test_an_unreachable_backend_ends_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    expected = {}
    with (
        LiveServer(_app(out, [closed], monkeypatch)) as server,
        httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as client,
    ):
        walk = Walk(server, client)
        for stream in (False, True):
            rid = f"refused-{stream}"
            walk.check(
                rid,
                _post(client, rid, _chat("ok", stream=stream)),
                Expected(502, "error", 502, "unreachable"),
            )
        expected = walk.expected
    _check_recorded(out, expected)


def test_a_recorder_backlog_ends_the_call(
    backend_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    real_write_table = pq.write_table
    gate = threading.Event()

    def slow_write_table(*args: Any, **kwargs: Any) -> None:
        gate.wait(10)  # the writer is stuck on a slow disk
        real_write_table(*args, **kwargs)

    app = _app(out, [backend_url], monkeypatch, recorder_queue_size=1)
    with (
        LiveServer(app) as server,
        httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as client,
    ):
        walk = Walk(server, client)
        rid = "backlog"
        with monkeypatch.context() as patch:
            patch.setattr(pq, "write_table", slow_write_table)
            answers = [_post(client, rid, _chat("ok")) for _ in range(3)]
            gate.set()
        accepted = [r for r in answers if r.status_code == 200]
        refused = answers[len(accepted)]
        assert accepted and all(r.status_code == 503 for r in answers[len(accepted) :])
        assert int(refused.headers["Retry-After"]) > 0
        assert "behind" in refused.json()["error"]["message"]
        walk.check(rid, refused, Expected(503, "ok", 200))  # the first call's turn
        expected = walk.expected
    _check_recorded(out, expected)


def _check_recorded(out: Path, expected: dict[str, Expected]) -> None:
    """The published shards hold each begun turn with its status, and every rollout."""
    reader = open_output(out)
    turns = reader.turns(
        columns=["rollout_id", "turn_index", "status", "http_status", "error"]
    ).to_pylist()
    by_rollout: dict[str, list[dict[str, Any]]] = {}
    for turn in turns:
        by_rollout.setdefault(turn["rollout_id"], []).append(turn)
    for rid, want in expected.items():
        got = sorted(by_rollout.get(rid, []), key=lambda t: t["turn_index"])
        if want.turn is None:
            assert got == [], (rid, got)
            continue
        assert got, f"{rid}: no turn recorded"
        turn = got[-1] if rid in ("t-journal",) else got[0]
        assert (turn["status"], turn["http_status"]) == (want.turn, want.http_status), (rid, turn)
        if want.error is not None:
            assert want.error in (turn["error"] or ""), (rid, turn["error"])
        elif want.turn == "ok":
            assert turn["error"] is None, (rid, turn)
    rows = reader.rollouts(columns=["rollout_id", "status"]).to_pylist()
    rollouts = {r["rollout_id"]: r for r in rows}
    begun = {rid for rid, want in expected.items() if want.turn is not None}
    assert begun <= rollouts.keys(), begun - rollouts.keys()
    assert all(rollouts[rid]["status"] == "finished" for rid in begun)


def test_a_failed_sample_write_keeps_the_rollout_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    settings = load_settings(None, {"output": out, "shard_max_rows": 1}, environ={})
    app = create_app(settings, backend=FakeVLLM())
    real_write_table = pq.write_table
    full = threading.Event()
    full.set()

    def write_table(arrow: Any, where: str, **kwargs: Any) -> None:
        if full.is_set() and "samples-" in where:  # the disk fills while samples are written
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write_table(arrow, where, **kwargs)

    monkeypatch.setattr(pq, "write_table", write_table)
    with TestClient(app) as client:
        assert client.post("/rollouts/r/v1/chat/completions", json=_chat("ok")).is_success
        assert client.post("/rollouts/r/finish").is_success
        _wait(lambda: client.get("/health").status_code == 503, "the sample write fails")
        full.clear()  # the writer's next roll publishes the samples and clears the error
        _wait(lambda: client.get("/health").status_code == 200, "recording recovers")
        assert client.post("/rollouts/s/v1/chat/completions", json=_chat("ok")).is_success
    rows = open_output(out).rollouts(columns=["rollout_id"]).to_pylist()
    samples = open_output(out).samples(columns=["rollout_id"]).to_pylist()
    assert {"r"} <= {r["rollout_id"] for r in rows}
    assert {"r"} <= {s["rollout_id"] for s in samples}
