"""Servers for tests: an ASGI app (Turnstile, the viewer) in a thread, under uvicorn or the
raw asyncio/httptools server (`server="raw"`, `turnstile.server.raw`).

`LiveServer(app)` serves any app on a free loopback port; `TurnstileServer` builds
Turnstile's app from settings (a real backend URL, an output directory, a tokenizer) and
serves it. Both are context managers, and `start()` / `stop()` do the same by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn
from aiohttp import web

from turnstile.limits import HEADER_READ_TIMEOUT_S
from turnstile.server.app import create_app
from turnstile.server.header_phase import bounded_http_protocol
from turnstile.server.raw import RawServer
from turnstile.settings import load_settings

# uvicorn binds and runs the app's start-up (the journal, the writer) within this.
START_TIMEOUT_S = 30.0
# In-flight calls drain and shards are published on the way out.
STOP_TIMEOUT_S = 60.0
_POLL_S = 0.01


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The servers `turnstile serve` offers that keep every HTTP behaviour the tests check
# (granian does not answer 408/431 in the header phase: see turnstile.bench.granian_serve).
SERVERS = ("uvicorn", "raw")


class LiveServer:
    """Runs an app on a loopback port in a background thread, under `server` as
    `turnstile serve` runs it (each request's head bounded in time and bytes)."""

    def __init__(
        self,
        app: Any,
        port: int | None = None,
        header_read_timeout_s: float = HEADER_READ_TIMEOUT_S,
        server: str = "uvicorn",
    ) -> None:
        self.app = app
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.kind = server
        if server == "raw":
            self.raw: RawServer | None = RawServer(
                app,
                port=self.port,
                header_timeout_s=header_read_timeout_s,
                install_signal_handlers=False,
            )
            self.thread = threading.Thread(target=self.raw.run)
            return
        self.raw = None
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="on",
            http=bounded_http_protocol(header_read_timeout_s),
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()))

    @property
    def started(self) -> bool:
        return self.raw.started if self.raw is not None else bool(self.server.started)

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"{self.kind} did not start within {START_TIMEOUT_S:g} s")
            time.sleep(_POLL_S)

    def stop(self) -> None:
        if self.raw is not None:
            self.raw.stop()
        else:
            self.server.should_exit = True
        self.thread.join(STOP_TIMEOUT_S)

    def __enter__(self) -> LiveServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class TurnstileServer(LiveServer):
    """Turnstile in front of `backend_url`, recording to `output`."""

    def __init__(
        self, backend_url: str, output: Path, tokenizer: Path | None, **overrides: Any
    ) -> None:
        port = free_port()
        settings = load_settings(
            None,
            {
                "backends": [backend_url],
                "output": output,
                "port": port,
                "tokenizer": tokenizer,
                "shard_max_age_s": 1.0,
                **overrides,
            },
            environ={},
        )
        super().__init__(create_app(settings), port, settings.header_read_timeout_s)
        self.output = output

    def __enter__(self) -> TurnstileServer:
        self.start()
        return self


@contextlib.contextmanager
def aiohttp_server(
    handle: Callable[[web.Request], Awaitable[web.StreamResponse]],
    *,
    shutdown_timeout_s: float = 60.0,
) -> Iterator[str]:
    """Serve `handle` (every method and path) over real HTTP on a loopback port, from an
    event loop in a thread of its own; yields the base URL."""
    port = free_port()
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    async def serve() -> web.AppRunner:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app, shutdown_timeout=shutdown_timeout_s)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    def run() -> None:
        asyncio.set_event_loop(loop)
        runner = loop.run_until_complete(serve())
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10), "the aiohttp server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
