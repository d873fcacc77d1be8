"""`turnstile recover DIR`: publish what a crashed run journaled, without serving.

The journal of an output directory (and those of a `--workers` run) is rebuilt into
its shards as `turnstile serve` does at start-up, and rollouts left open are sealed as
`interrupted`, as a clean shutdown would.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from turnstile.backends.protocol import BackendResponse
from turnstile.cli.verify import journal_dirs
from turnstile.errors import BackendUnreachable
from turnstile.server.workers import WorkerSpec
from turnstile.settings import Settings, load_settings

if TYPE_CHECKING:
    from fastapi import FastAPI

NAME = "recover"
HELP = "publish what a crashed run journaled, without serving"
DESCRIPTION = (
    "Rebuild the shards of an output directory from its journal (as "
    "`turnstile serve` does at start-up) and seal rollouts left open as interrupted."
)


class _NoBackend:
    """Recovery talks to no backend."""

    base_url = "none"

    async def request(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> BackendResponse:
        raise BackendUnreachable("no backend during offline recovery")

    async def aclose(self) -> None:
        return None


def publish_offline(settings: Settings) -> None:
    """Publish everything the journals hold, as a start-up and a clean shutdown would."""
    from turnstile.server.app import create_app

    for worker, _ in journal_dirs(settings.output) or [(None, settings.output)]:
        # Offline there are no peers: each worker's journal is rebuilt on its own.
        solo = None if worker is None else WorkerSpec(worker.index, 1, worker.rundir)
        app = create_app(settings, backend=_NoBackend(), worker=solo)
        asyncio.run(_start_and_stop(app))


async def _start_and_stop(app: FastAPI) -> None:
    async with app.router.lifespan_context(app):
        pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", type=Path)


def run(args: argparse.Namespace) -> int:
    from turnstile.server.logs import setup_logging

    setup_logging("info")
    settings = load_settings(None, {"output": args.directory, "fsync": "always"})
    publish_offline(settings)
    return 0
