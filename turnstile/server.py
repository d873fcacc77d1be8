"""Runs the app under uvicorn until SIGTERM/SIGINT, then exits 0 once all is published."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import FrameType

import uvicorn

from turnstile.app import create_app
from turnstile.proxy import Proxy
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

    def __init__(self, config: uvicorn.Config, proxy: Proxy, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._proxy = proxy
        self._drain_timeout_s = drain_timeout_s
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is None and not self.should_exit:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None:
                self._proxy.draining = True
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


def run_server(settings: Settings) -> None:
    """Serve until SIGINT/SIGTERM; everything received is published before returning."""
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        # uvicorn's own wait for open connections; the app drains in-flight calls too.
        timeout_graceful_shutdown=int(settings.drain_timeout_s) or None,
    )
    GracefulServer(config, app.state.proxy, settings.drain_timeout_s).run()
