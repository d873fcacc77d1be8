"""`turnstile verify DIR`: check every shard of an output directory, and the journal.

Every published shard (of the data tables and of the quarantine) opens, has the declared
schema of its table and the current schema version, and reads in full; every journaled
turn is in the turns shards or in the quarantine. Exits 1 on any problem, and 2 when
all is accounted for but rows are in the quarantine (they need an operator's look).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from turnstile.journal.codec import CodecError, EventKind, decode_turn
from turnstile.journal.rebuild import JOURNAL_DIR, published_keys, quarantined_keys
from turnstile.journal.wal import read_journal
from turnstile.output.schema import ALL_TABLES, QUARANTINE, SCHEMAS
from turnstile.reader import ShardFormatError, check_shard, open_output
from turnstile.server.workers import WorkerSpec

NAME = "verify"
HELP = "check every shard of an output directory against the schema"
DESCRIPTION = (
    "Check that every published shard opens, matches its table's schema and "
    "version and reads in full, and that every journaled turn is in the shards or in "
    "the quarantine. Exits 1 on any problem, 2 when rows are quarantined."
)

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_QUARANTINED = 2
# Quarantined rows listed with their reason; the rest are counted.
SHOW_QUARANTINED = 10


@dataclass(slots=True)
class VerifyReport:
    shards: dict[str, int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    journal_frames: int = 0
    journal_turns: int = 0
    published_turns: int = 0  # journaled turns found in the turns shards
    quarantined_turns: int = 0  # journaled turns found in the quarantine
    unpublished_turns: int = 0
    quarantined: dict[str, int] = field(default_factory=dict)  # rows, by intended table
    quarantine_reasons: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def exit_code(self) -> int:
        if self.problems:
            return EXIT_PROBLEMS
        return EXIT_QUARANTINED if self.quarantined else EXIT_OK


def verify(output: Path) -> VerifyReport:
    report = VerifyReport()
    for table in ALL_TABLES:
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
    if report.problems:  # the shards cannot be compared with the journal
        return report
    if report.shards[QUARANTINE]:
        _read_quarantine(output, report)
    frames = [f for _, d in journal_dirs(output) for f in read_journal(d)]
    report.journal_frames = len(frames)
    if not any(frame.kind == EventKind.TURN for frame in frames):
        return report
    published, _, _ = published_keys(output)
    held, _ = quarantined_keys(output)
    for frame in frames:
        if frame.kind != EventKind.TURN:
            continue
        try:
            turn = decode_turn(frame.payload)
        except CodecError as exc:
            report.problems.append(f"journal frame {frame.seq}: {exc}")
            continue
        report.journal_turns += 1
        key = (turn.turn_id, turn.choice_index)
        if key in held:
            report.quarantined_turns += 1
        elif key in published:
            report.published_turns += 1
        else:
            report.unpublished_turns += 1
    if report.unpublished_turns:
        report.problems.append(
            f"{report.unpublished_turns} journaled turns are not in published shards "
            "(nor in the quarantine): run `turnstile recover` (or start `turnstile serve` "
            "on this directory)"
        )
    return report


def _read_quarantine(output: Path, report: VerifyReport) -> None:
    rows = open_output(output).quarantine(columns=["table", "rollout_id", "reason"]).to_pylist()
    for row in rows:
        report.quarantined[row["table"]] = report.quarantined.get(row["table"], 0) + 1
    report.quarantine_reasons = [
        f"{r['table']} row of rollout {r['rollout_id']}: {r['reason']}"
        for r in rows[:SHOW_QUARANTINED]
    ]


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
        f"journal: {report.journal_frames} frames, {report.journal_turns} turns: "
        f"{report.published_turns} in shards, {report.quarantined_turns} quarantined, "
        f"{report.unpublished_turns} in neither"
    )
    for problem in report.problems:
        print(f"PROBLEM: {problem}")
    if report.quarantined:
        held = ", ".join(f"{n} {table}" for table, n in sorted(report.quarantined.items()))
        print(f"QUARANTINED: {held} rows could not be written to their tables:")
        for reason in report.quarantine_reasons:
            print(f"  {reason}")
        more = sum(report.quarantined.values()) - len(report.quarantine_reasons)
        if more > 0:
            print(f"  ... and {more} more (read them with `open_output(DIR).quarantine()`)")
    if report.problems:
        print(f"{len(report.problems)} problems")
    elif report.quarantined:
        print("every journaled turn is accounted for, but rows are quarantined")
    else:
        print("ok")
    return report.exit_code
