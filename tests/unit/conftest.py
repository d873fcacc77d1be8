"""Fixtures for unit tests: the whole app over the backend and sink seams, with fakes."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from tests.fakes_backend import FakeVLLM, Reply
from tests.fakes_sink import InMemorySink
from tests.live import LiveServer
from turnstile.dev.cache import NO_BUILD_ENV
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


_LOOPBACK_HOSTS = frozenset({"localhost", "::1", "0.0.0.0", "::"})


def _is_loopback(address: object) -> bool:
    if not isinstance(address, tuple) or not address:
        return True  # AF_UNIX paths and abstract sockets
    host = str(address[0])
    return host in _LOOPBACK_HOSTS or host.startswith("127.")


@pytest.fixture(autouse=True, scope="session")
def _no_network_and_no_downloads(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """tests/unit needs no network and no downloads: connections to anything but loopback
    fail, and the development cache is an empty directory that refuses to build anything
    (the tests that need llama.cpp's assets are in tests/integration, marked ``assets``)."""
    real_connect = socket.socket.connect
    real_connect_ex = socket.socket.connect_ex

    def connect(self: socket.socket, address: Any) -> None:
        if not _is_loopback(address):
            raise OSError(f"tests/unit may not connect to {address!r}: no network")
        real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        if not _is_loopback(address):
            raise OSError(f"tests/unit may not connect to {address!r}: no network")
        return real_connect_ex(self, address)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", connect)
        patch.setattr(socket.socket, "connect_ex", connect_ex)
        patch.setenv("TURNSTILE_CACHE", str(tmp_path_factory.mktemp("empty-cache")))
        patch.setenv(NO_BUILD_ENV, "1")
        yield
