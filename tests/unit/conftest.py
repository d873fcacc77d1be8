"""Fixtures for unit tests: the whole app over the backend and sink seams, with fakes."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI

from tests.fakes_backend import FakeVLLM, Reply
from tests.fakes_sink import InMemorySink
from turnstile.app import create_app
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


class LiveServer:
    """Runs an app under uvicorn on a free loopback port in a background thread."""

    def __init__(self, app: FastAPI) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()))

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start within 10 s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture
def live() -> Iterator[Callable[[FastAPI], LiveServer]]:
    servers: list[LiveServer] = []

    def _start(app: FastAPI) -> LiveServer:
        server = LiveServer(app).__enter__()
        servers.append(server)
        return server

    yield _start
    for server in servers:
        server.__exit__()
