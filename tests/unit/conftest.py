"""Unit tests run offline: no network but loopback, and nothing built or downloaded.

``make_app`` and ``live`` (the app over fakes, and a live server for it) come from
``tests/conftest.py``; ``MakeApp`` is re-exported here for the tests that annotate with it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import Harness, MakeApp
from turnstile.dev.cache import NO_BUILD_ENV

__all__ = ["Harness", "MakeApp"]

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
