"""Runs the app until SIGTERM/SIGINT, then exits 0 once all is published.

The HTTP server is `settings.server`: uvicorn (`GracefulServer`, the default) or the raw
asyncio/httptools protocol (`turnstile.server.raw`); both drain the same way before they
stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import uvicorn

from turnstile.proxy.core import Proxy
from turnstile.server.app import create_app
from turnstile.server.header_phase import bounded_http_protocol
from turnstile.server.workers import WorkerSpec, socket_path
from turnstile.settings import Settings

log = logging.getLogger("turnstile")


class GracefulServer(uvicorn.Server):
    """A uvicorn server that drains before it stops, and then exits 0.

    On the first SIGTERM/SIGINT the proxy starts draining: `/health` and new calls
    answer 503 while calls in flight get up to the drain timeout to finish; only then
    does uvicorn stop listening and run the shutdown that seals and publishes. A second
    signal stops at once. Plain uvicorn would close the listener immediately and
    re-raise the signal at the end, so the process would die with -15 although
    everything was published; supervisors and compose read that as a crash.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        proxy: Proxy,
        drain_timeout_s: float,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self._proxy = proxy
        self._drain_timeout_s = drain_timeout_s
        self._on_started = on_started
        self._drain_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Start the app and listen; then call `on_started` (the app answers from now on)."""
        await super().startup(sockets)
        if self.started and self._on_started is not None:
            self._on_started()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is None and not self.should_exit:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None:
                self._proxy.start_draining()
                log.info("draining: %d calls in flight", self._proxy.in_flight)
                self._drain_task = loop.create_task(self._drain_then_exit(sig, frame))
                return
        self._exit(sig, frame)

    async def _drain_then_exit(self, sig: int, frame: FrameType | None) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._proxy.idle.wait(), self._drain_timeout_s)
        self._exit(sig, frame)

    def _exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()


def run_server(
    settings: Settings,
    worker: WorkerSpec | None = None,
    on_started: Callable[[], None] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM; everything received is published before returning.
    `on_started` is called once the app has started and the socket listens.

    As one of several workers it shares the port (SO_REUSEPORT) and also listens on its
    Unix socket, where the other workers hand over calls for rollouts it owns.
    """
    app = create_app(settings, worker=worker)
    sockets = None
    if worker is not None:
        sockets = [
            _shared_tcp_socket(settings.host, settings.port),
            _unix_socket(socket_path(worker.rundir, worker.index)),
        ]
    proxy: Proxy = app.state.proxy
    if settings.server == "raw":
        from turnstile.server.raw import RawServer

        RawServer(
            app,
            host=settings.host,
            port=settings.port,
            header_timeout_s=settings.header_read_timeout_s,
            proxy=proxy,
            drain_timeout_s=settings.drain_timeout_s,
            on_started=on_started,
        ).run(sockets)
        return
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        # Each request's line and headers are bounded in time and bytes (slowloris).
        http=bounded_http_protocol(settings.header_read_timeout_s),
        # uvicorn's own wait for open connections; the app drains in-flight calls too.
        timeout_graceful_shutdown=int(settings.drain_timeout_s) or None,
    )
    server = GracefulServer(config, proxy, settings.drain_timeout_s, on_started)
    server.run(sockets=sockets)


# Pending connections per worker socket, as uvicorn's default: bursts of hundreds of
# rollouts connecting at once must not be refused.
LISTEN_BACKLOG = 2048


def _shared_tcp_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    sock.set_inheritable(True)
    return sock


def _unix_socket(path: Path) -> socket.socket:
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    os.chmod(path, 0o600)  # only this user's processes may hand calls over
    sock.listen(LISTEN_BACKLOG)
    return sock
