"""Fixtures for every test: the whole app over the backend and sink seams, with fakes, and a
live server for it on loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from tests.fakes_backend import FakeVLLM, Reply
from tests.fakes_sink import InMemorySink
from tests.live import SERVERS, LiveServer
from turnstile.server.app import create_app
from turnstile.settings import load_settings


@dataclass
class Harness:
    app: FastAPI
    backend: FakeVLLM
    sink: InMemorySink


MakeApp = Callable[..., Harness]


@pytest.fixture
def make_app(tmp_path: Path) -> MakeApp:
    def _make(script: Callable[[dict[str, Any]], Reply] | None = None, **overrides: Any) -> Harness:
        backend = FakeVLLM(script) if script is not None else FakeVLLM()
        sink = InMemorySink()
        settings = load_settings(None, {"output": tmp_path / "out", **overrides}, environ={})
        return Harness(create_app(settings, backend=backend, sink=sink), backend, sink)

    return _make


@pytest.fixture(params=SERVERS)
def live(request: pytest.FixtureRequest) -> Iterator[Callable[..., LiveServer]]:
    """Serves apps over real sockets, once under each server `turnstile serve` offers."""
    servers: list[LiveServer] = []

    def _start(app: FastAPI, **options: Any) -> LiveServer:
        options.setdefault("server", request.param)
        server = LiveServer(app, **options).__enter__()
        servers.append(server)
        return server

    yield _start
    for server in servers:
        server.__exit__()
