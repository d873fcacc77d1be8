"""The engines' own pause and resume around a weight push (`turnstile.backends.control`):
vLLM's and SGLang's routes over real HTTP on loopback, every replica of a pool, the
dialect of an auto-detected backend, and the proxy's fence driving them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from aiohttp import web

from tests.live import aiohttp_server
from turnstile.backends.aiohttp_client import AiohttpBackend
from turnstile.backends.control import (
    AutoControl,
    BroadcastControl,
    EnginePauseMode,
    SGLangControl,
    VLLMControl,
    engine_control,
)
from turnstile.backends.pool import BackendPool
from turnstile.backends.protocol import Timeouts
from turnstile.backends.sglang import AutoKindBackend, SGLangBackend
from turnstile.errors import BackendError
from turnstile.server.app import create_app
from turnstile.settings import load_settings

TIMEOUTS = Timeouts(5, 5, 5, 5)


class Engine:
    """A loopback server answering an engine's control routes (vLLM's or SGLang's) and
    `/v1/models` with its `owned_by`; it records each call."""

    def __init__(self, owner: str, *, refuse: bool = False) -> None:
        self.owner = owner
        self.refuse = refuse
        self.calls: list[tuple[str, str, Any]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw) if raw else None
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "m", "owned_by": self.owner}]})
        self.calls.append((request.method, request.path_qs, body))
        if self.refuse:
            return web.json_response({"error": "not in dev mode"}, status=404)
        return web.json_response({"status": "ok"})


@pytest.fixture
def engines() -> Iterator[list[tuple[Engine, str]]]:
    """Two SGLang engines and one vLLM engine, each on its own port."""
    made = [Engine("sglang"), Engine("sglang"), Engine("vllm")]
    with (
        aiohttp_server(made[0].handle) as a,
        aiohttp_server(made[1].handle) as b,
        aiohttp_server(made[2].handle) as c,
    ):
        yield list(zip(made, [a, b, c], strict=True))


def _client(url: str) -> AiohttpBackend:
    return AiohttpBackend(url, TIMEOUTS, pool_size=2)


def _cycle(backend: Any, mode: EnginePauseMode, *, resume: bool = True) -> Any:
    """Pause (and resume) `backend`'s engines in a loop of their own, its clients closed
    after; the control used."""
    control = engine_control(backend)

    async def run() -> None:
        try:
            await control.pause(mode)
            if resume:
                await control.resume()
        finally:
            await backend.aclose()

    asyncio.run(run())
    return control


@pytest.mark.parametrize(("mode", "sglang_mode"), [("pause", "retract"), ("abort", "abort")])
def test_sglang_is_paused_and_continued_on_its_own_routes(
    engines: list[tuple[Engine, str]], mode: EnginePauseMode, sglang_mode: str
) -> None:
    (engine, url), *_ = engines
    control = _cycle(SGLangBackend(_client(url)), mode)
    assert isinstance(control, SGLangControl)
    assert engine.calls == [
        ("POST", "/pause_generation", {"mode": sglang_mode}),
        ("POST", "/continue_generation", {}),
    ]


def test_vllm_is_paused_and_resumed_on_its_dev_routes(engines: list[tuple[Engine, str]]) -> None:
    engine, url = engines[2]
    control = _cycle(_client(url), "pause")
    assert isinstance(control, VLLMControl)
    assert engine.calls == [("POST", "/pause?mode=wait", None), ("POST", "/resume", None)]


def test_an_auto_detected_backend_is_driven_in_its_dialect(
    engines: list[tuple[Engine, str]],
) -> None:
    (sglang, s_url), _, (vllm, v_url) = engines
    for url in (s_url, v_url):
        control = _cycle(AutoKindBackend(_client(url)), "abort")
        assert isinstance(control, AutoControl)
    assert [c[1] for c in sglang.calls] == ["/pause_generation", "/continue_generation"]
    assert [c[1] for c in vllm.calls] == ["/pause?mode=abort", "/resume"]


def test_every_replica_of_a_pool_is_paused(engines: list[tuple[Engine, str]]) -> None:
    (a, a_url), (b, b_url), (c, c_url) = engines
    pool = BackendPool(
        {
            None: [SGLangBackend(_client(a_url)), SGLangBackend(_client(b_url))],
            "other": [_client(c_url)],
        }
    )
    control = _cycle(pool, "pause")
    assert isinstance(control, BroadcastControl)
    assert (
        [x[1] for x in a.calls]
        == [x[1] for x in b.calls]
        == [
            "/pause_generation",
            "/continue_generation",
        ]
    )
    assert [x[1] for x in c.calls] == ["/pause?mode=wait", "/resume"]


def test_a_replica_that_refuses_is_an_error_after_the_others_are_paused(
    engines: list[tuple[Engine, str]],
) -> None:
    (a, a_url), (b, b_url), _ = engines
    b.refuse = True
    pool = BackendPool({None: [SGLangBackend(_client(a_url)), SGLangBackend(_client(b_url))]})
    with pytest.raises(BackendError) as caught:
        _cycle(pool, "pause", resume=False)
    assert "not in dev mode" in str(caught.value)  # the refusing engine's own answer
    assert [x[1] for x in a.calls] == [x[1] for x in b.calls] == ["/pause_generation"]


def test_the_fence_drives_sglangs_routes_through_the_app(
    engines: list[tuple[Engine, str]], tmp_path: Any, live: Any
) -> None:
    (engine, url), *_ = engines
    settings = load_settings(
        None,
        {
            "output": tmp_path / "out",
            "backends": url,
            "backend_kind": "sglang",
            "backend_pause": True,
        },
        environ={},
    )
    server = live(create_app(settings))
    paused = httpx.post(f"{server.url}/admin/pause", json={"mode": "pause"}, timeout=30)
    assert paused.status_code == 200, paused.text
    resumed = httpx.post(f"{server.url}/admin/resume", json={"policy_version": 3}, timeout=30)
    assert resumed.status_code == 200 and resumed.json()["policy_version"] == 3
    assert [(c[1], c[2]) for c in engine.calls] == [
        ("/pause_generation", {"mode": "retract"}),
        ("/continue_generation", {}),
    ]
