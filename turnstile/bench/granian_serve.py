"""Turnstile under granian's embedded ASGI server (Rust HTTP), for `turnstile bench` only.

`python -m turnstile.bench.granian_serve <turnstile serve flags>` serves the same app as
`turnstile serve` under granian, so that `turnstile bench --servers uvicorn,raw,granian`
can compare it with the two servers `turnstile serve` offers. It needs the optional
extra (`pip install 'turnstile[granian]'`) and runs in this process's event loop
(granian's experimental embedded mode), one worker, HTTP/1 only, with the app's lifespan.

It is not a `server` setting because it does not keep the header phase's contract:
a client dribbling its headers is closed without the 408 answer, and an endless head is
answered 431 without the OpenAI-style body (measured with granian 2.8); nor can it share
its port with other workers' sockets (`--workers` must be 1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from turnstile.limits import HEADER_READ_TIMEOUT_S
from turnstile.server.raw import LISTEN_BACKLOG, run_loop

if TYPE_CHECKING:
    from turnstile.proxy.core import Proxy

log = logging.getLogger("turnstile.granian")


def granian_installed() -> bool:
    try:
        import granian.server.embed  # noqa: F401
    except ImportError:
        return False
    return True


class _StartupSignal:
    """The app, with an event set once its lifespan start-up is complete."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.started = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def watched(message: Message) -> None:
            await send(message)
            if message["type"] == "lifespan.startup.complete":
                self.started.set()

        await self.app(scope, receive, watched)


class GranianServer:
    """Serves `app` under granian until stopped; `stop()` may be called from any thread.
    Drains `proxy` on the first SIGTERM/SIGINT as `RawServer` does."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        header_timeout_s: float = HEADER_READ_TIMEOUT_S,
        proxy: Proxy | None = None,
        drain_timeout_s: float = 0.0,
        on_started: Callable[[], None] | None = None,
        install_signal_handlers: bool = True,
    ) -> None:
        self.app = _StartupSignal(app)
        self.host = host
        self.port = port
        self.header_timeout_s = header_timeout_s
        self.proxy = proxy
        self.drain_timeout_s = drain_timeout_s
        self.on_started = on_started
        self.install_signal_handlers = install_signal_handlers
        self.started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None
        self._drain: asyncio.Task[None] | None = None

    def stop(self) -> None:
        if self._loop is not None and self._server is not None:
            self._loop.call_soon_threadsafe(self._server.stop)

    def run(self) -> None:
        run_loop(self.serve())

    async def serve(self) -> None:
        from granian.constants import HTTPModes, Interfaces
        from granian.http import HTTP1Settings
        from granian.server.embed import Server

        loop = self._loop = asyncio.get_running_loop()
        self._server = Server(
            self.app,
            address=self.host,
            port=self.port,
            interface=Interfaces.ASGI,
            http=HTTPModes.http1,
            websockets=False,
            backlog=LISTEN_BACKLOG,
            http1_settings=HTTP1Settings(header_read_timeout=int(self.header_timeout_s * 1000)),
            log_enabled=False,
        )
        serving = asyncio.ensure_future(self._server.serve())
        started = asyncio.ensure_future(self.app.started.wait())
        await asyncio.wait((serving, started), return_when=asyncio.FIRST_COMPLETED)
        if serving.done():
            started.cancel()
            serving.result()
            raise RuntimeError("granian stopped before the app started")
        self.started = True
        if self.install_signal_handlers:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._signalled)
        if self.on_started is not None:
            self.on_started()
        try:
            await serving
        finally:
            if self.install_signal_handlers:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

    def _signalled(self) -> None:
        if self._drain is None and self.proxy is not None:
            self.proxy.start_draining()
            log.info("draining: %d calls in flight", self.proxy.in_flight)
            self._drain = asyncio.ensure_future(self._drain_then_stop())
            return
        self._server.stop()

    async def _drain_then_stop(self) -> None:
        assert self.proxy is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proxy.idle.wait(), self.drain_timeout_s)
        self._server.stop()


def main(argv: list[str] | None = None) -> int:
    """`turnstile serve`'s flags; the app as it builds it, served by `GranianServer`."""
    from turnstile.cli.serve import _overrides, add_arguments
    from turnstile.server.app import create_app
    from turnstile.server.logs import setup_logging
    from turnstile.settings import load_settings

    parser = argparse.ArgumentParser(prog="python -m turnstile.bench.granian_serve")
    add_arguments(parser)
    args = parser.parse_args(argv)
    settings = load_settings(args.config, _overrides(args))
    if settings.workers != 1 or settings.server != "uvicorn":
        print(
            "granian_serve runs one worker under granian: no --workers, no --server",
            file=sys.stderr,
        )
        return 2
    if not granian_installed():
        print("granian is not installed: pip install 'turnstile[granian]'", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format)
    app = create_app(settings)
    GranianServer(
        app,
        host=settings.host,
        port=settings.port,
        header_timeout_s=settings.header_read_timeout_s,
        proxy=app.state.proxy,
        drain_timeout_s=settings.drain_timeout_s,
    ).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
