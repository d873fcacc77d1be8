"""The record sink: buffered, atomically published Parquet shards.

`ParquetShardSink` buffers records per table and writes each batch as one Parquet shard.
A shard is written under `<output>/.tmp/`, flushed to disk, then renamed into
`<output>/<table>/part-<unix_ms>-<writer_id>-<seq>.parquet`, so readers only ever see
complete files. The staging directory is hidden (pyarrow.dataset skips names starting
with `.` or `_`) and staged files end in `.partial`, because DuckDB and Polars globs such
as `samples/*.parquet` do match dot files: a staged file must not match `*.parquet`.

Shard names start with a zero-padded millisecond timestamp, so a plain sort of the
names of one table orders shards by publication time across all writers; the writer id
and a per-writer sequence number make names unique. Each live writer needs its own
writer id.

Each writer also keeps a manifest of the shards it has published,
`<output>/_manifests/<writer_id>.json`, in the same format as the object-store
manifests (`turnstile.output.objstore`), rewritten atomically (temp file + `os.replace`) after
every publish. In a local directory the rename of a shard is its commit and readers list
the table directories; the manifest is an index of which replica wrote what. At start-up
it is rebuilt from this writer's shards on disk, so a crash between a publish and the
manifest rewrite leaves it complete again on the next start.

Thread-safety: a sink is not thread-safe. It is meant to be owned by one background
writer thread that calls every method (writes, `maybe_roll`, `flush`, `close`); other
threads hand records to that thread instead of calling the sink.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from turnstile.journal.fsync import fsync_path
from turnstile.limits import OUTPUT_FILE_MODE
from turnstile.output.quarantine import CONVERSION_ERRORS, isolate, quarantine
from turnstile.output.schema import (
    ALL_TABLES,
    MEDIA,
    META_WRITER,
    QUARANTINE,
    TableName,
    dictionary_columns,
    media_table,
    quarantine_table,
    rollouts_table,
    samples_table,
    schema_metadata,
    statistics_columns,
    turns_table,
)
from turnstile.reader import MANIFEST_DIR, MANIFEST_SUFFIX, MANIFEST_VERSION
from turnstile.records import (
    MediaRecord,
    QuarantineRecord,
    RolloutRecord,
    SampleRecord,
    TurnRecord,
)

# A turn row with 2,000 prompt and 500 completion tokens is about 10 KiB of token data
# before compression, so 4,096 rows make shards of a few tens of MiB: large enough for
# efficient scans, small enough to build in memory in well under a second.
DEFAULT_MAX_ROWS: Final[int] = 4096
# A trainer that polls the output sees a record at most this long after it was written,
# even when traffic is light; 30 s keeps the shard count low (about 120 per hour per
# table and writer at worst).
DEFAULT_MAX_AGE_S: Final[float] = 30.0
# zstd level 1 compresses token ids and logprobs nearly as well as higher levels at a
# fraction of the CPU time; the writer must keep up with the proxy on one core.
ZSTD_LEVEL: Final[int] = 1

SHARD_PREFIX: Final[str] = "part-"
SHARD_SUFFIX: Final[str] = ".parquet"
STAGING_DIR: Final[str] = ".tmp"
STAGING_SUFFIX: Final[str] = ".partial"
SHARD_GLOB: Final[str] = f"{SHARD_PREFIX}*{SHARD_SUFFIX}"

log = logging.getLogger("turnstile.shards")

# A media shard holds about this many bytes of images (a row group is held in memory
# while it is written): a few hundred screenshots.
MEDIA_SHARD_BYTES: Final[int] = 64 * 1024 * 1024
# Hashes of the images this writer has stored, so each is stored once; past this many
# (64 MiB of hashes) the memory is cleared, and an image seen again is stored again.
MAX_REMEMBERED_MEDIA: Final[int] = 1_000_000
# The tables whose rows name images by hash.
_REFER_TO_MEDIA: Final[frozenset[str]] = frozenset({"turns", "samples"})

_WRITER_ID_RE: Final[re.Pattern[str]] = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,159}")
_STAGED_RE: Final[re.Pattern[str]] = re.compile(
    r"(?P<table>[a-z]+)-part-(?P<ms>\d{13})-(?P<writer>.+)-(?P<seq>\d{6,})\.parquet\.partial"
)


class SinkError(Exception):
    """The sink could not write or publish a shard (disk full, permissions, ...)."""


class Sink(Protocol):
    """Where the proxy's records go. Called from a single writer thread."""

    def write_turns(self, records: Sequence[TurnRecord]) -> None: ...

    def write_samples(self, records: Sequence[SampleRecord]) -> None: ...

    def write_rollouts(self, records: Sequence[RolloutRecord]) -> None: ...

    def write_media(self, records: Sequence[MediaRecord]) -> None:
        """Image bytes: stored once per hash, published no later than the turns and
        samples written after them (which refer to them)."""
        ...

    def write_quarantine(self, records: Sequence[QuarantineRecord]) -> None:
        """Rows the writer could not make into records of their table, with the reason."""
        ...

    def maybe_roll(self, now: float | None = None) -> None:
        """Publish the buffers that are full or older than the age limit."""
        ...

    def flush(self) -> None:
        """Publish everything buffered now."""
        ...

    def close(self) -> None:
        """Flush, then refuse further writes."""
        ...

    def progress(self) -> SinkProgress:
        """Rows accepted and rows settled per table, counted since the sink was opened."""
        ...


@dataclass(frozen=True, slots=True)
class SinkProgress:
    """How far a sink has got, per table, as row counts since it was opened.

    Rows are published in the order they were written, so every row written while
    `accepted[t]` was N is published once `settled[t] >= N`. Settled rows are in a
    published shard of their table, or in a published shard of the quarantine (they
    could not be converted to Arrow; `quarantined[t]` counts them and
    `quarantine_reason` gives the latest reason). The recorder uses this to tell when the
    journal frames behind a record may be removed, and to report quarantined rows.
    """

    accepted: Mapping[str, int]
    settled: Mapping[str, int]
    quarantined: Mapping[str, int] = field(default_factory=dict)
    quarantine_reason: str | None = None

    def covers(self, marks: Mapping[str, int]) -> bool:
        """Whether every row counted in `marks` (an earlier `accepted`) is settled."""
        return all(self.settled.get(t, 0) >= n for t, n in marks.items())


_Builder = Callable[..., pa.Table]
_BUILDERS: Final[Mapping[TableName, _Builder]] = {
    "turns": turns_table,
    "samples": samples_table,
    "rollouts": rollouts_table,
    "media": media_table,
    "quarantine": quarantine_table,
}


class _Settled:
    """Stands in a buffer for a row already in a published shard (of its table or of the
    quarantine), so the row still counts in its table's order, and is not published
    again, when the rest of its chunk is."""

    __slots__ = ()


_SETTLED: Final = _Settled()


@dataclass(slots=True)
class _Buffer:
    records: list[Any] = field(default_factory=list)
    oldest: float | None = None  # time.time() when the oldest record arrived
    data_bytes: int = 0  # media: the image bytes buffered


def shard_name(unix_ms: int, writer_id: str, seq: int) -> str:
    """The published file name of a shard."""
    return f"{SHARD_PREFIX}{unix_ms:013d}-{writer_id}-{seq:06d}{SHARD_SUFFIX}"


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def _describe(error: OSError) -> str:
    return error.strerror or str(error)


class ParquetShardSink:
    """Buffers records per table and publishes them as zstd Parquet shards.

    A table's buffer is published when it holds `max_rows` rows (checked on every
    write) or when its oldest row is older than `max_age_s` (checked by `maybe_roll`,
    which the owner calls periodically). A shard never holds more than `max_rows` rows.

    `identity` (model, tokenizer, version, ...) is read each time a shard is written, so
    the owner may fill in values that are only known after start-up; it goes into every
    shard's schema metadata together with `turnstile.writer` = `writer_id`.

    If writing fails with an `OSError`, the staged file is removed, nothing is
    published, the records stay buffered for the next attempt and `SinkError` is
    raised. A record that cannot be converted to Arrow (retrying cannot help) is
    isolated from its chunk and published to the `quarantine` table with the reason;
    the rest of the chunk is published as usual, and `progress()` counts the
    quarantined rows. Nothing is ever dropped.
    """

    def __init__(
        self,
        output_dir: Path,
        *,
        writer_id: str,
        identity: Mapping[str, str],
        max_rows: int = DEFAULT_MAX_ROWS,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        fsync: bool = True,
        manifest: bool = True,
    ) -> None:
        if not _WRITER_ID_RE.fullmatch(writer_id):
            raise ValueError(
                f"writer_id {writer_id!r} must be 1-160 characters of letters, digits, "
                "'_', '.' or '-', starting with a letter or digit"
            )
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, not {max_rows}")
        if max_age_s <= 0:
            raise ValueError(f"max_age_s must be positive, not {max_age_s}")
        self.output_dir = Path(output_dir)
        self.writer_id = writer_id
        self.max_rows = max_rows
        self.max_age_s = max_age_s
        self.fsync = fsync
        self._identity = identity
        self._buffers: dict[TableName, _Buffer] = {t: _Buffer() for t in ALL_TABLES}
        self._seq = 0
        self._last_ms = 0
        self._closed = False
        self.shards_published = 0
        self.rows_published: dict[TableName, int] = dict.fromkeys(ALL_TABLES, 0)
        self._accepted: dict[str, int] = dict.fromkeys(ALL_TABLES, 0)
        self._settled: dict[str, int] = dict.fromkeys(ALL_TABLES, 0)
        self._quarantined: dict[str, int] = {}
        self._quarantine_reason: str | None = None
        self._staging = self.output_dir / STAGING_DIR
        # This writer's published shards by "table/name" (None: no manifest is kept).
        self._manifest: dict[str, dict[str, Any]] | None = {} if manifest else None
        self._manifest_dirty = False
        schema_metadata("turns", {**identity, META_WRITER: writer_id})  # ValueError if invalid
        try:
            self._prepare_dirs()
        except OSError as e:
            raise SinkError(
                f"cannot prepare output directory {self.output_dir}: {_describe(e)}"
            ) from e
        self._media_stored: set[str] = self._stored_media()

    def _stored_media(self) -> set[str]:
        """The hashes of the images already in the output's media shards (any writer's)."""
        stored: set[str] = set()
        for path in sorted((self.output_dir / MEDIA).glob(SHARD_GLOB)):
            try:
                column = pq.read_table(path, columns=["sha256"]).column("sha256")
            except (OSError, pa.ArrowException, KeyError) as e:
                log.warning("cannot read the image hashes of %s: %s", path, e)
                continue
            stored.update(column.to_pylist())
            if len(stored) >= MAX_REMEMBERED_MEDIA:
                break
        return stored

    def _prepare_dirs(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._staging.mkdir(exist_ok=True)
        for table in ALL_TABLES:
            (self.output_dir / table).mkdir(exist_ok=True)
        for staged in self._staging.iterdir():
            match = _STAGED_RE.fullmatch(staged.name)
            if match and match["writer"] == self.writer_id:
                _remove_quietly(staged)  # left by a crashed predecessor with this id
        if self.fsync:
            fsync_path(self.output_dir)
        if self._manifest is not None:
            own = re.compile(
                rf"{re.escape(SHARD_PREFIX)}\d{{13}}-{re.escape(self.writer_id)}-\d{{6,}}"
                rf"{re.escape(SHARD_SUFFIX)}"
            )
            for table in ALL_TABLES:
                for path in (self.output_dir / table).glob(SHARD_GLOB):
                    if own.fullmatch(path.name):
                        self._manifest[f"{table}/{path.name}"] = {
                            "table": table,
                            "name": path.name,
                            "bytes": path.stat().st_size,
                        }
            self._write_manifest()

    @property
    def manifest_path(self) -> Path:
        """This writer's manifest of published shards."""
        return self.output_dir / MANIFEST_DIR / f"{self.writer_id}{MANIFEST_SUFFIX}"

    def _write_manifest(self) -> None:
        """Rewrite the manifest atomically; a failure is logged and retried on the next
        publish (the shards themselves are published and readable either way)."""
        if self._manifest is None:
            return
        manifest = {
            "manifest_version": MANIFEST_VERSION,
            "writer_id": self.writer_id,
            "updated_at": time.time(),
            "shards": sorted(self._manifest.values(), key=lambda e: (e["name"], e["table"])),
        }
        final = self.manifest_path
        tmp = final.with_name(f".{final.name}.tmp")
        try:
            final.parent.mkdir(exist_ok=True)
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, OUTPUT_FILE_MODE
            )
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps(manifest, indent=1).encode())
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
            if self.fsync:
                fsync_path(final.parent)
        except OSError as e:
            self._manifest_dirty = True
            _remove_quietly(tmp)
            log.warning("cannot rewrite the manifest %s: %s", final, _describe(e))
            return
        self._manifest_dirty = False

    # ------------------------------------------------------------ Sink protocol

    def write_turns(self, records: Sequence[TurnRecord]) -> None:
        self._write("turns", records)

    def write_samples(self, records: Sequence[SampleRecord]) -> None:
        self._write("samples", records)

    def write_rollouts(self, records: Sequence[RolloutRecord]) -> None:
        self._write("rollouts", records)

    def write_media(self, records: Sequence[MediaRecord]) -> None:
        fresh: list[MediaRecord] = []
        for record in records:
            if record.sha256 in self._media_stored:
                continue
            if len(self._media_stored) >= MAX_REMEMBERED_MEDIA:
                self._media_stored.clear()  # a repeat row costs space, never correctness
            self._media_stored.add(record.sha256)
            fresh.append(record)
        self._buffers[MEDIA].data_bytes += sum(len(r.data) for r in fresh)
        self._write(MEDIA, fresh)

    def write_quarantine(self, records: Sequence[QuarantineRecord]) -> None:
        self._write(QUARANTINE, records)

    def maybe_roll(self, now: float | None = None) -> None:
        """Publish full buffers and buffers older than `max_age_s`.

        `now` is a `time.time()` reading (default: the current one).
        """
        now = time.time() if now is None else now
        self._publish_each(
            [
                t
                for t, b in self._buffers.items()
                if b.records
                and (
                    len(b.records) >= self.max_rows
                    or (b.oldest is not None and now - b.oldest >= self.max_age_s)
                )
            ]
        )

    def seconds_until_roll(self, now: float | None = None) -> float | None:
        """Seconds until some buffer reaches the age limit (0: due), None if all empty."""
        now = time.time() if now is None else now
        ages = [now - b.oldest for b in self._buffers.values() if b.oldest is not None]
        return max(0.0, self.max_age_s - max(ages)) if ages else None

    def flush(self) -> None:
        self._publish_each([t for t, b in self._buffers.items() if b.records])

    def close(self) -> None:
        """Flush every table, then refuse further writes; raises the first failure."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            if self._manifest_dirty:
                self._write_manifest()

    def progress(self) -> SinkProgress:
        return SinkProgress(
            dict(self._accepted),
            dict(self._settled),
            dict(self._quarantined),
            self._quarantine_reason,
        )

    # ------------------------------------------------------------ internals

    @property
    def closed(self) -> bool:
        return self._closed

    def buffered(self, table: TableName) -> int:
        """Rows of `table` buffered and not yet published."""
        return len(self._buffers[table].records)

    def _write(self, table: TableName, records: Sequence[Any]) -> None:
        if self._closed:
            raise SinkError(f"sink for {self.output_dir} is closed")
        if not records:
            return
        buffer = self._buffers[table]
        buffer.records.extend(records)
        self._accepted[table] += len(records)
        if buffer.oldest is None:
            buffer.oldest = time.time()
        while len(buffer.records) >= self.max_rows or buffer.data_bytes >= MEDIA_SHARD_BYTES:
            self._publish_chunk(table)

    def _publish_each(self, tables: Sequence[TableName]) -> None:
        """Publish every buffered row of `tables`; one table failing does not stop the
        others, and the error names every failure."""
        failures: list[SinkError] = []
        for table in tables:
            try:
                while self._buffers[table].records:
                    self._publish_chunk(table)
            except SinkError as e:
                failures.append(e)
        if len(failures) == 1:
            raise failures[0]
        if failures:
            raise SinkError("; ".join(str(e) for e in failures)) from failures[0]

    def _publish_chunk(self, table: TableName) -> None:
        if table in _REFER_TO_MEDIA:  # a reader never finds a hash the media lack
            while self._buffers[MEDIA].records:
                self._publish_chunk(MEDIA)
        buffer = self._buffers[table]
        chunk = buffer.records[: self._chunk_rows(buffer)]
        rows = [r for r in chunk if r is not _SETTLED]
        identity = self._shard_identity()
        build = _BUILDERS[table]
        parts: list[tuple[Sequence[Any], pa.Table]] = []
        if rows:
            try:
                parts = [(rows, build(rows, identity=identity))]
            except CONVERSION_ERRORS:
                if table == QUARANTINE:
                    raise SinkError(
                        f"cannot convert {len(rows)} quarantine rows to Arrow; they stay buffered"
                    ) from None
                parts = self._quarantine_bad_rows(table, chunk, rows, identity)
        for part, arrow in parts:
            final = self._publish_table(table, arrow)
            self._remember(table, final)
            self.shards_published += 1
            self.rows_published[table] += len(part)
            if len(parts) > 1:  # a failure after this part must not publish it again
                self._mark_settled(table, chunk, part)
            if self.fsync:
                try:
                    fsync_path(final.parent)
                except OSError as e:
                    # Not settled: the journal keeps these rows until a restart
                    # re-publishes them.
                    self._consume(buffer, len(chunk))
                    raise SinkError(
                        f"published {final} but cannot sync its directory: {_describe(e)}"
                    ) from e
        self._consume(buffer, len(chunk))
        self._settled[table] += len(chunk)

    def _quarantine_bad_rows(
        self, table: TableName, chunk: list[Any], rows: list[Any], identity: dict[str, str]
    ) -> list[tuple[Sequence[Any], pa.Table]]:
        """Publish the rows of `chunk` that cannot be converted to the quarantine, mark
        them in the buffer, and return the others as tables to publish.

        The quarantine shard is published before the buffer changes: if that fails,
        nothing changed and the next attempt isolates the same rows again. The good rows
        go out as one shard where they convert together (as good as always).
        """
        build = _BUILDERS[table]
        parts, bad = isolate(rows, lambda part: build(part, identity=identity))
        if bad:
            held = [quarantine(table, row, f"cannot convert to Arrow: {why}") for row, why in bad]
            try:
                arrow = quarantine_table(held, identity=identity)
            except CONVERSION_ERRORS as e:  # quarantine rows are made safe: a bug
                raise SinkError(f"cannot quarantine {len(held)} {table} rows: {e}") from e
            final = self._publish_table(QUARANTINE, arrow)
            self._remember(QUARANTINE, final)
            self.shards_published += 1
            self.rows_published[QUARANTINE] += len(held)
            self._accepted[QUARANTINE] += len(held)
            self._settled[QUARANTINE] += len(held)
            self._quarantined[table] = self._quarantined.get(table, 0) + len(held)
            self._quarantine_reason = f"{table}: {held[-1].reason}"
            self._mark_settled(table, chunk, [row for row, _ in bad])
            for record in held:
                log.error(
                    "QUARANTINED a %s row (rollout %s, turn %s, choice %s, sample %s): %s",
                    table,
                    record.rollout_id,
                    record.turn_id,
                    record.choice_index,
                    record.sample_index,
                    record.reason,
                )
        good = [row for part, _ in parts for row in part]
        if len(parts) > 1:
            with contextlib.suppress(*CONVERSION_ERRORS):
                return [(good, build(good, identity=identity))]
        return parts

    def _mark_settled(self, table: TableName, chunk: list[Any], rows: Sequence[Any]) -> None:
        """Stand `_SETTLED` in for `rows` (already in a shard) in the buffer of `table`."""
        settled = {id(row) for row in rows}
        records = self._buffers[table].records
        for i, record in enumerate(chunk):
            if id(record) in settled:
                records[i] = _SETTLED

    def _remember(self, table: TableName, final: Path) -> None:
        """Add a published shard to this writer's manifest."""
        if self._manifest is None:
            return
        with contextlib.suppress(OSError):
            self._manifest[f"{table}/{final.name}"] = {
                "table": table,
                "name": final.name,
                "bytes": final.stat().st_size,
            }
        self._write_manifest()

    def _shard_identity(self) -> dict[str, str]:
        identity = {**self._identity, META_WRITER: self.writer_id}
        try:
            schema_metadata("turns", identity)
        except ValueError as e:
            raise SinkError(f"invalid shard identity: {e}") from e
        return identity

    def _chunk_rows(self, buffer: _Buffer) -> int:
        """Rows of the next shard: `max_rows`, and for media no more than about
        `MEDIA_SHARD_BYTES` of images (at least one)."""
        if not buffer.data_bytes:
            return self.max_rows
        size = rows = 0
        for record in buffer.records[: self.max_rows]:
            rows += 1
            size += len(record.data) if isinstance(record, MediaRecord) else 0
            if size >= MEDIA_SHARD_BYTES:
                break
        return rows

    @staticmethod
    def _consume(buffer: _Buffer, count: int) -> None:
        if buffer.data_bytes:
            buffer.data_bytes -= sum(
                len(r.data) for r in buffer.records[:count] if isinstance(r, MediaRecord)
            )
        del buffer.records[:count]
        buffer.oldest = time.time() if buffer.records else None

    def _next_name(self) -> str:
        unix_ms = max(time.time_ns() // 1_000_000, self._last_ms)
        self._last_ms = unix_ms
        self._seq += 1
        return shard_name(unix_ms, self.writer_id, self._seq)

    def _publish_table(self, table: TableName, arrow: pa.Table) -> Path:
        """Stage, sync and rename one shard; on failure nothing is published."""
        name = self._next_name()
        table_dir = self.output_dir / table
        final = table_dir / name
        staged = self._staging / f"{table}-{name}{STAGING_SUFFIX}"
        try:
            self._staging.mkdir(exist_ok=True)
            table_dir.mkdir(exist_ok=True)
            pq.write_table(
                arrow,
                str(staged),
                compression="zstd",
                compression_level=ZSTD_LEVEL,
                use_dictionary=dictionary_columns(table),
                write_statistics=statistics_columns(table),
            )
            os.chmod(staged, OUTPUT_FILE_MODE)
            if self.fsync:
                fsync_path(staged)
            if final.exists():
                raise FileExistsError(
                    f"{final} already exists: is another writer using id {self.writer_id!r}?"
                )
            os.rename(staged, final)
        except OSError as e:
            _remove_quietly(staged)
            raise SinkError(
                f"cannot publish {arrow.num_rows} {table} rows as {final}: {_describe(e)}"
            ) from e
        return final
