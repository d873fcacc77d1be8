"""The real backend client against a real HTTP server on loopback: what it asks for, and
how its timeouts are named."""

from __future__ import annotations

import asyncio
import gzip
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from aiohttp import web
from starlette.testclient import TestClient

from turnstile.backends.aiohttp_client import AiohttpBackend, redact_url
from turnstile.backends.protocol import Timeouts
from turnstile.errors import BackendTimeout, BackendUnreachable
from turnstile.server.app import create_app
from turnstile.settings import load_settings

BODY = b'{"choices": []}'


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def gzipping_backend() -> AsyncIterator[tuple[str, list[str]]]:
    """Compresses whenever the request allows gzip, as servers behind a CDN do."""
    seen: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        accepted = request.headers.get("Accept-Encoding", "")
        seen.append(accepted)
        if "gzip" in accepted:
            return web.Response(
                body=gzip.compress(BODY),
                headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
            )
        return web.Response(body=BODY, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    runner, url = await _serve(app)
    yield url, seen
    await runner.cleanup()


async def test_answers_are_asked_for_uncompressed(gzipping_backend: tuple[str, list[str]]) -> None:
    url, seen = gzipping_backend
    backend = AiohttpBackend(url, Timeouts(5, 5, 5, 5), pool_size=2)
    try:
        resp = await backend.request("POST", "/v1/chat/completions", b"{}", {})
        assert await resp.read() == BODY
        resp.close()
        assert seen == ["identity"]
        # A passthrough client that chose an encoding gets it, relayed as is.
        resp = await backend.request(
            "POST", "/v1/chat/completions", b"{}", {"Accept-Encoding": "gzip"}
        )
        assert gzip.decompress(await resp.read()) == BODY
        resp.close()
    finally:
        await backend.aclose()


@pytest.fixture
async def stalling_backend() -> AsyncIterator[str]:
    """Sends one byte, then nothing for 1 s."""

    async def handle(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b"x")
        await asyncio.sleep(1)
        return out

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    runner, url = await _serve(app)
    yield url
    await runner.cleanup()


async def test_the_total_timeout_is_reported_as_such(stalling_backend: str) -> None:
    # The silence outlasts the total deadline (0.4 s) before the idle one (2 s): the error
    # names the total timeout, not an idle timeout of 0.4 s.
    backend = AiohttpBackend(
        stalling_backend, Timeouts(connect_s=2, first_byte_s=2, idle_s=2, total_s=0.4), pool_size=1
    )
    try:
        resp = await backend.request("POST", "/v1/chat/completions", b"{}", {})
        with pytest.raises(BackendTimeout, match=r"total timeout of 0\.4 s"):
            async for _ in resp.iter_chunks():
                pass
        resp.close()
    finally:
        await backend.aclose()


SECRET = "s3cret-pass"


async def test_credentials_in_the_url_are_used_and_never_shown(
    gzipping_backend: tuple[str, list[str]],
) -> None:
    url, _ = gzipping_backend
    with_credentials = url.replace("http://", f"http://user:{SECRET}@")
    backend = AiohttpBackend(with_credentials, Timeouts(5, 5, 5, 5), pool_size=1)
    try:
        assert SECRET not in backend.base_url and backend.base_url.startswith("http://***@")
        resp = await backend.request("POST", "/v1/chat/completions", b"{}", {})
        assert await resp.read() == BODY
        resp.close()
    finally:
        await backend.aclose()
    port = url.rpartition(":")[2]
    dead = AiohttpBackend(f"http://user:{SECRET}@127.0.0.1:1", Timeouts(5, 5, 5, 5), pool_size=1)
    try:
        with pytest.raises(BackendUnreachable) as caught:
            await dead.request("POST", "/v1/chat/completions", b"{}", {})
        assert SECRET not in str(caught.value) and port not in str(caught.value)
    finally:
        await dead.aclose()


def test_redact_url() -> None:
    assert redact_url("http://a:b@host:8000/x") == "http://***@host:8000/x"
    assert redact_url("http://host:8000") == "http://host:8000"
    assert redact_url("https://tok%40en@h") == "https://***@h"


def test_a_dead_backend_with_credentials_leaks_them_nowhere(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    settings = load_settings(
        None,
        {"output": tmp_path / "out", "backends": [f"http://user:{SECRET}@127.0.0.1:1"]},
        environ={},
    )
    with TestClient(create_app(settings)) as client:
        resp = client.post(
            "/rollouts/r/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert resp.status_code == 502 and SECRET not in resp.text
        assert "***@127.0.0.1:1" in resp.text
        assert SECRET not in client.get("/stats").text
        client.post("/rollouts/r/finish")
    assert SECRET not in caplog.text
    shards = sorted((tmp_path / "out").rglob("*.parquet"))
    assert shards  # the failed turn and its rollout are recorded
    for shard in shards:
        metadata = pq.read_metadata(shard).metadata or {}
        assert all(SECRET.encode() not in v for v in metadata.values())
        assert SECRET not in repr(pq.read_table(shard).to_pylist())
    assert b"***@127.0.0.1:1" in pq.read_metadata(shards[0]).metadata[b"turnstile.backend"]


async def test_a_body_of_many_mebibytes_reaches_the_backend_whole() -> None:
    """Screenshot rollouts carry tens of MiB of inline images: the body is sent as is, with
    its length, and without aiohttp's large-bytes ResourceWarning (an error in this suite)."""
    received: list[tuple[bytes, str | None, str | None]] = []

    async def handle(request: web.Request) -> web.Response:
        received.append(
            (
                await request.read(),
                request.headers.get("Content-Length"),
                request.headers.get("Content-Type"),
            )
        )
        return web.Response(body=BODY, content_type="application/json")

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/v1/chat/completions", handle)
    runner, url = await _serve(app)
    backend = AiohttpBackend(url, Timeouts(5, 5, 5, 5), pool_size=2)
    body = bytes(range(256)) * (12 * 2**20 // 256) + b"tail"
    try:
        resp = await backend.request(
            "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"}
        )
        assert await resp.read() == BODY
        resp.close()
    finally:
        await backend.aclose()
        await runner.cleanup()
    assert received == [(body, str(len(body)), "application/json")]
