"""`turnstile verify` and `turnstile recover`: check an output directory, repair it offline.

verify: every published shard opens, has the declared schema of its table and the
current schema version, and reads in full; no journaled turn is missing from the
shards. recover: replays the journal into the shards without serving (what
`turnstile serve` does at start-up), sealing rollouts left open as `interrupted`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
from fastapi import FastAPI

from turnstile.errors import BackendUnreachable
from turnstile.journal.codec import CodecError, EventKind, decode_turn
from turnstile.journal.rebuild import JOURNAL_DIR, published_keys
from turnstile.journal.wal import read_journal
from turnstile.output.schema import SCHEMAS, TABLES
from turnstile.reader import ShardFormatError, check_shard
from turnstile.server.workers import WorkerSpec
from turnstile.settings import Settings


@dataclass(slots=True)
class VerifyReport:
    shards: dict[str, int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    journal_frames: int = 0
    unpublished_turns: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(output: Path) -> VerifyReport:
    report = VerifyReport()
    for table in TABLES:
        paths = sorted((output / table).glob("part-*.parquet"))
        report.shards[table], report.rows[table] = len(paths), 0
        for path in paths:
            try:
                check_shard(path, table)
                schema = pq.read_schema(path).remove_metadata()
                if not schema.equals(SCHEMAS[table].remove_metadata()):
                    report.problems.append(f"{path}: schema differs from the {table} schema")
                    continue
                report.rows[table] += pq.read_table(path).num_rows
            except (ShardFormatError, OSError, ValueError) as exc:
                report.problems.append(f"{path}: {exc}")
    frames = [f for _, d in journal_dirs(output) for f in read_journal(d)]
    report.journal_frames = len(frames)
    if any(frame.kind == EventKind.TURN for frame in frames):
        if report.problems:  # the shards cannot be compared with the journal
            return report
        published, _, _ = published_keys(output)
        for frame in frames:
            if frame.kind != EventKind.TURN:
                continue
            try:
                turn = decode_turn(frame.payload)
            except CodecError as exc:
                report.problems.append(f"journal frame {frame.seq}: {exc}")
                continue
            if (turn.turn_id, turn.choice_index) not in published:
                report.unpublished_turns += 1
        if report.unpublished_turns:
            report.problems.append(
                f"{report.unpublished_turns} journaled turns are not in published shards: "
                "run `turnstile recover` (or start `turnstile serve` on this directory)"
            )
    return report


class _NoBackend:
    """Recovery talks to no backend."""

    base_url = "none"

    async def request(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> None:
        raise BackendUnreachable("no backend during offline recovery")

    async def aclose(self) -> None:
        return None


def journal_dirs(output: Path) -> list[tuple[WorkerSpec | None, Path]]:
    """The journal of a single-process run, and those of `--workers` runs (`w<i>`)."""
    root = output / JOURNAL_DIR
    if not root.is_dir():
        return []
    found: list[tuple[WorkerSpec | None, Path]] = [(None, root)]
    workers = sorted(
        (int(d.name[1:]), d) for d in root.iterdir() if d.is_dir() and d.name[1:].isdigit()
    )
    count = max((i for i, _ in workers), default=-1) + 1
    found += [(WorkerSpec(i, count, output), d) for i, d in workers]
    return found


def recover_offline(settings: Settings) -> None:
    """Publish everything the journals hold, as a start-up and a clean shutdown would."""
    from turnstile.server.app import create_app

    for worker, _ in journal_dirs(settings.output) or [(None, settings.output)]:
        # Offline there are no peers: each worker's journal is replayed on its own.
        solo = None if worker is None else WorkerSpec(worker.index, 1, worker.rundir)
        app = create_app(settings, backend=_NoBackend(), worker=solo)  # type: ignore[arg-type]
        asyncio.run(_start_and_stop(app))


async def _start_and_stop(app: FastAPI) -> None:
    async with app.router.lifespan_context(app):
        pass
