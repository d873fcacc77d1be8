"""Runs the app under uvicorn until SIGTERM/SIGINT, then exits 0 once all is published."""

from __future__ import annotations

from types import FrameType

import uvicorn

from turnstile.app import create_app
from turnstile.settings import Settings


class GracefulServer(uvicorn.Server):
    """A uvicorn server that exits 0 after a graceful SIGTERM/SIGINT shutdown.

    Plain uvicorn re-raises the signal once it has shut down, so the process would die
    with -15 although everything was drained and published; supervisors and compose
    read that as a crash.
    """

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()


def run_server(settings: Settings) -> None:
    """Serve until SIGINT/SIGTERM; everything received is published before returning."""
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        # uvicorn's own wait for open connections; the app drains in-flight calls too.
        timeout_graceful_shutdown=int(settings.drain_timeout_s) or None,
    )
    GracefulServer(config).run()
