"""`turnstile verify DIR`: check every shard of an output directory, and the journal.

Every published shard opens, has the declared schema of its table and the current
schema version, and reads in full; no journaled turn is missing from the shards.
Exits 1 on any problem.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from turnstile.journal.codec import CodecError, EventKind, decode_turn
from turnstile.journal.rebuild import JOURNAL_DIR, published_keys
from turnstile.journal.wal import read_journal
from turnstile.output.schema import SCHEMAS, TABLES
from turnstile.reader import ShardFormatError, check_shard
from turnstile.server.workers import WorkerSpec

NAME = "verify"
HELP = "check every shard of an output directory against the schema"
DESCRIPTION = (
    "Check that every published shard opens, matches its table's schema and "
    "version and reads in full, and that no journaled turn is missing from the shards. "
    "Exits 1 on any problem."
)

EXIT_OK = 0
EXIT_PROBLEMS = 1


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", type=Path)


def run(args: argparse.Namespace) -> int:
    report = verify(args.directory)
    for table in report.shards:
        print(f"{table}: {report.shards[table]} shards, {report.rows[table]} rows")
    print(
        f"journal: {report.journal_frames} frames, {report.unpublished_turns} turns "
        "not yet in shards"
    )
    for problem in report.problems:
        print(f"PROBLEM: {problem}")
    print("ok" if report.ok else f"{len(report.problems)} problems")
    return EXIT_OK if report.ok else EXIT_PROBLEMS
