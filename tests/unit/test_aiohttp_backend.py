"""The real backend client against a real HTTP server on loopback: what it asks for, and
how its timeouts are named."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from turnstile.backends.aiohttp_client import AiohttpBackend
from turnstile.backends.protocol import Timeouts
from turnstile.errors import BackendTimeout

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
