"""A write-ahead journal: framed, checksummed, group-committed appends to segment files.

`append` is cheap: it assigns a sequence number and queues the payload. A committer
thread writes queued frames and fsyncs them per the policy; `wait_durable` (async) or
`commit` (blocking) returns once a frame's fate is decided: durable, or `JournalError`.

Frame, little-endian:

    u8 magic/version | u32 payload length | u32 CRC-32 | u64 seq | u8 kind | payload

The CRC (zlib.crc32) covers seq, kind and payload. Segments are `journal-<seq:020d>.wal`,
named by the first sequence number they may hold; a journal opened on a directory
repairs it (truncating a torn or corrupt tail of the last segment) and then writes to
a fresh segment. Segments are removed only by `remove_through`, once the caller has
published their records elsewhere.

Policies decide when a frame counts as durable (when `wait_durable` returns):
- `always`: once written and fsynced. Appends queued meanwhile share the next write and
  fsync (group commit). Survives a process crash and a power loss.
- `interval` (the default): once written to the file (the kernel's page cache), which
  a process crash (`kill -9`, OOM) cannot undo; the file is fsynced at most `interval_s`
  after its first unsynced write, so a power loss loses at most the frames
  acknowledged in that window. Acknowledging costs one write(), not an fsync.
- `never`: once written; syncing is left to the OS. Survives a process crash only.
A failed write is truncated away and its frames fail; a failed fsync fails the journal
for good (the kernel may have dropped the dirty pages), so it must be reopened, which
re-reads what is really on disk.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import errno
import fcntl
import heapq
import itertools
import os
import re
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal, Protocol

from turnstile.errors import Overloaded
from turnstile.journal.fsync import fsync_path
from turnstile.limits import OUTPUT_FILE_MODE
from turnstile.runtime import name_thread

FsyncPolicy = Literal["always", "interval", "never"]

# The power-loss window of `interval`: at most this long between a frame's write and its
# fsync. 5 ms caps fsyncs at 200/s (IOPS-priced volumes allow that), and a power loss
# then loses at most the last 5 ms of acknowledged turns, which a trainer's run loses
# anyway to the GPUs going down with it.
DEFAULT_GROUP_COMMIT_S = 0.005
# Acknowledged turns survive any process crash; acknowledging never waits for an fsync.
DEFAULT_FSYNC_POLICY: FsyncPolicy = "interval"
# ~1300 turns of 50 KB: few files and rare directory fsyncs, yet a published segment
# frees its disk space soon after its turns reach a shard.
DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
# Queued but unwritten bytes: ~5000 turns of 50 KB. Past this the disk is hopelessly
# behind and appends refuse (503, backpressure) rather than grow memory without bound.
DEFAULT_MAX_PENDING_BYTES = 256 * 1024 * 1024
# A turn carries a request (<= 32 MiB) and a response (<= 64 MiB) plus token arrays;
# a length field above this is corruption, not a frame.
MAX_PAYLOAD_BYTES = 256 * 1024 * 1024
# A full disk or a busy committer clears within seconds, or an operator is needed.
JOURNAL_RETRY_AFTER_S = 1

# Version 1 of the frame format. Nonzero so that a zero-filled tail (blocks allocated
# but never written before a crash) is recognised as not-a-frame.
MAGIC = 0xA1
_HEADER = struct.Struct("<BIIQB")  # magic, payload length, crc, seq, kind
HEADER_BYTES = _HEADER.size
_SEQ_KIND = struct.Struct("<QB")
_SEGMENT_RE = re.compile(r"^journal-(\d{20})\.wal$")
_LOCK_NAME = "journal.lock"


class JournalError(Overloaded):
    """The journal cannot make a frame durable now (disk full, I/O error, closed)."""

    def __init__(self, message: str, *, retry_after_s: int = JOURNAL_RETRY_AFTER_S) -> None:
        super().__init__(message, retry_after_s=retry_after_s)


@dataclass(frozen=True, slots=True)
class Frame:
    seq: int
    kind: int
    payload: bytes
    segment_id: int
    offset: int  # of the frame's header within its segment


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    segment_id: int  # every frame in it has segment_id <= seq < end_seq
    path: Path
    size_bytes: int
    end_seq: int | None  # the next segment's id; None for the last one
    active: bool  # the journal is appending to it


@dataclass(slots=True)
class RepairReport:
    segments: int = 0
    frames: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    truncated_bytes: int = 0  # cut from the tail of the last segment
    corrupt_frames: int = 0  # frames failing the magic, length, CRC or order checks
    skipped_bytes: int = 0  # left in place after a bad frame of an earlier segment
    problems: list[str] = field(default_factory=list)


class Journal(Protocol):
    """What the proxy needs from a journal."""

    def append(self, kind: int, payload: bytes) -> int:
        """Queue a frame; returns its sequence number. JournalError when refused."""

    async def wait_durable(self, seq: int) -> None:
        """Return once `seq` is durable; JournalError if it never will be."""

    def commit(self, seq: int, timeout: float | None = None) -> None:
        """Blocking `wait_durable`, for threads."""

    @property
    def last_seq(self) -> int: ...

    @property
    def healthy(self) -> bool: ...

    def frames(self) -> Iterator[Frame]:
        """The frames that were on disk when the journal was opened, in order."""

    def segments(self) -> list[SegmentInfo]: ...

    def remove_through(self, segment_id: int) -> int:
        """Delete segments up to `segment_id` once their records are published."""

    def close(self) -> None: ...


def segment_name(segment_id: int) -> str:
    return f"journal-{segment_id:020d}.wal"


def encode_frame(seq: int, kind: int, payload: bytes) -> bytes:
    crc = zlib.crc32(payload, zlib.crc32(_SEQ_KIND.pack(seq, kind)))
    return _HEADER.pack(MAGIC, len(payload), crc, seq, kind) + payload


def list_segments(directory: Path) -> list[tuple[int, Path]]:
    """The segment files of a journal directory, oldest first."""
    found = []
    for entry in os.scandir(directory):
        match = _SEGMENT_RE.match(entry.name)
        if match and entry.is_file(follow_symlinks=False):
            found.append((int(match.group(1)), Path(entry.path)))
    return sorted(found)


@dataclass(slots=True)
class _SegmentScan:
    frames: int = 0
    valid_bytes: int = 0
    size: int = 0
    last_seq: int | None = None
    bad: str | None = None  # why the scan stopped before the end
    torn: bool = False  # it stopped at an incomplete frame (not a checksum failure)


def _scan_frames(
    f: BinaryIO, segment_id: int, after_seq: int, scan: _SegmentScan
) -> Iterator[Frame]:
    """Valid frames from the start of `f`; fills `scan` with where and why it stopped."""
    scan.size = os.fstat(f.fileno()).st_size
    pos = 0
    while pos < scan.size:
        if scan.size - pos < HEADER_BYTES:
            scan.bad, scan.torn = f"incomplete header at {pos}", True
            return
        magic, length, crc, seq, kind = _HEADER.unpack(f.read(HEADER_BYTES))
        if magic != MAGIC or length > MAX_PAYLOAD_BYTES:
            scan.bad = f"no frame at {pos} (magic {magic:#x}, length {length})"
            return
        if scan.size - pos - HEADER_BYTES < length:
            scan.bad, scan.torn = f"frame at {pos} runs past the end", True
            return
        payload = f.read(length)
        if zlib.crc32(payload, zlib.crc32(_SEQ_KIND.pack(seq, kind))) != crc:
            scan.bad = f"checksum mismatch at {pos}"
            return
        if seq < segment_id or seq <= after_seq:
            scan.bad = f"sequence {seq} out of order at {pos}"
            return
        yield Frame(seq, kind, payload, segment_id, pos)
        after_seq = seq
        pos += HEADER_BYTES + length
        scan.frames, scan.valid_bytes, scan.last_seq = scan.frames + 1, pos, seq


def read_frames(path: Path) -> Iterator[Frame]:
    """Every valid frame of one segment file, up to its first bad one (never raises on
    garbage; an unreadable file raises OSError)."""
    match = _SEGMENT_RE.match(path.name)
    segment_id = int(match.group(1)) if match else 0
    with open(path, "rb") as f:
        yield from _scan_frames(f, segment_id, -1, _SegmentScan())


def read_journal(directory: Path) -> Iterator[Frame]:
    """Every valid frame of a journal directory in sequence order, skipping the rest of a
    segment after a bad frame. Read-only: run `repair` (or open a `FileJournal`) first."""
    return _read_segments(list_segments(directory))


def _read_segments(segments: list[tuple[int, Path]]) -> Iterator[Frame]:
    after = -1
    for segment_id, path in segments:
        scan = _SegmentScan()
        with open(path, "rb") as f:
            yield from _scan_frames(f, segment_id, after, scan)
        if scan.last_seq is not None:
            after = scan.last_seq


def _repair(directory: Path, *, sync: bool) -> RepairReport:
    report = RepairReport()
    segments = list_segments(directory)
    report.segments = len(segments)
    after = -1
    for i, (segment_id, path) in enumerate(segments):
        scan = _SegmentScan()
        with open(path, "rb") as f:
            for frame in _scan_frames(f, segment_id, after, scan):
                report.first_seq = frame.seq if report.first_seq is None else report.first_seq
        report.frames += scan.frames
        if scan.last_seq is not None:
            after = report.last_seq = scan.last_seq
        if scan.bad is None:
            continue
        report.corrupt_frames += 0 if scan.torn and i == len(segments) - 1 else 1
        cut = scan.size - scan.valid_bytes
        if i == len(segments) - 1:
            report.truncated_bytes += cut
            report.problems.append(f"{path.name}: {scan.bad}; truncated {cut} bytes")
            with open(path, "r+b") as f:
                f.truncate(scan.valid_bytes)
                if sync:
                    os.fsync(f.fileno())
        else:
            report.skipped_bytes += cut
            report.problems.append(f"{path.name}: {scan.bad}; skipped {cut} bytes")
    return report


def _lock(directory: Path) -> int:
    fd = os.open(directory / _LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, OUTPUT_FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise JournalError(f"journal {directory} is in use by another process") from None
    return fd


def repair(directory: Path) -> RepairReport:
    """Truncate a torn or corrupt tail of the last segment; count what is there."""
    lock = _lock(directory)
    try:
        return _repair(directory, sync=True)
    finally:
        os.close(lock)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.EIO, "write made no progress")
        view = view[written:]


_Pending = tuple[int, int, bytes]  # seq, kind, payload
_Waiter = tuple[int, int, asyncio.AbstractEventLoop, "asyncio.Future[None]"]


class FileJournal:
    """The journal on local files (see the module docstring)."""

    def __init__(
        self,
        directory: Path,
        *,
        fsync: FsyncPolicy = DEFAULT_FSYNC_POLICY,
        interval_s: float = DEFAULT_GROUP_COMMIT_S,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
    ) -> None:
        if fsync not in ("always", "interval", "never"):
            raise ValueError(f"unknown fsync policy {fsync!r}")
        if interval_s < 0 or segment_bytes <= 0 or max_pending_bytes <= 0:
            raise ValueError("interval_s, segment_bytes and max_pending_bytes must be positive")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._policy: FsyncPolicy = fsync
        self._sync = fsync != "never"  # fsync files and directories at all
        self._sync_each = fsync == "always"  # fsync before a frame counts as durable
        self._dirty_since: float | None = None  # interval: first write not yet fsynced
        self._interval_s = interval_s
        self._segment_bytes = segment_bytes
        self._max_pending = max_pending_bytes
        self._lock_fd = _lock(self.directory)
        try:
            self.repair_report = _repair(self.directory, sync=self._sync)
            self._segment_ids = self._drop_empty_tail()
        except OSError as exc:
            os.close(self._lock_fd)
            raise JournalError(f"journal repair failed: {exc}") from exc
        self._opened_ids = list(self._segment_ids)
        last = max([self.repair_report.last_seq or 0, *self._segment_ids])
        self._cond = threading.Condition()
        self._seg_lock = threading.Lock()
        self._next_seq = last + 1
        self._decided_seq = last  # every seq up to here is durable or failed
        self._failures: list[tuple[int, int, JournalError]] = []  # (lo, hi, why), sorted
        self._error: JournalError | None = None  # set when the journal failed for good
        self._last_batch_failed = False
        self._pending: list[_Pending] = []
        self._pending_bytes = 0
        self._waiters: list[_Waiter] = []
        self._tiebreak = itertools.count()
        self._closing = False
        self._closed = False
        self._fd = -1
        self._active: int | None = None
        self._active_size = 0
        self._thread = threading.Thread(target=self._run, name="journal-commit", daemon=True)
        self._thread.start()

    def _drop_empty_tail(self) -> list[int]:
        segments = list_segments(self.directory)
        if segments and segments[-1][1].stat().st_size == 0:
            segments[-1][1].unlink()
            if self._sync:
                fsync_path(self.directory)
            segments.pop()
        return [segment_id for segment_id, _ in segments]

    # -- appending -----------------------------------------------------------------------
    def append(self, kind: int, payload: bytes) -> int:
        """Queue a frame and return its sequence number (not yet durable)."""
        if not 0 <= kind <= 0xFF:
            raise ValueError(f"frame kind {kind} does not fit in a byte")
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise ValueError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
        size = HEADER_BYTES + len(payload)
        with self._cond:
            if self._error is not None:
                raise JournalError(self._error.message)
            if self._closing:
                raise JournalError("the journal is closed")
            if self._pending and self._pending_bytes + size > self._max_pending:
                raise JournalError("the journal's write buffer is full")
            seq = self._next_seq
            self._next_seq += 1
            if not self._pending:
                self._cond.notify_all()
            self._pending.append((seq, kind, payload))
            self._pending_bytes += size
        return seq

    @property
    def last_seq(self) -> int:
        """The most recently assigned sequence number (0 before the first frame)."""
        with self._cond:
            return self._next_seq - 1

    @property
    def healthy(self) -> bool:
        """False once closed, failed, or while the last write failed (e.g. disk full)."""
        with self._cond:
            return self._error is None and not self._closing and not self._last_batch_failed

    # -- waiting for durability ------------------------------------------------------------
    def _outcome(self, seq: int) -> JournalError | Literal[False] | None:
        """Under the lock: None if durable, the error if failed, False if undecided."""
        if not 0 < seq < self._next_seq:
            raise ValueError(f"sequence number {seq} was never assigned")
        if seq > self._decided_seq:
            return self._error if self._error is not None else False
        i = bisect.bisect_right(self._failures, seq, key=lambda f: f[0]) - 1
        if i >= 0 and self._failures[i][0] <= seq <= self._failures[i][1]:
            return self._failures[i][2]
        return None

    async def wait_durable(self, seq: int) -> None:
        """Return once frame `seq` is durable per the policy; raise JournalError if not."""
        loop = asyncio.get_running_loop()
        with self._cond:
            outcome = self._outcome(seq)
            if outcome is False:
                future: asyncio.Future[None] = loop.create_future()
                heapq.heappush(self._waiters, (seq, next(self._tiebreak), loop, future))
        if outcome is False:
            await future
        elif outcome is not None:
            raise JournalError(outcome.message)

    def commit(self, seq: int, timeout: float | None = None) -> None:
        """Block until frame `seq` is durable; JournalError if it failed or timed out."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._outcome(seq) is not False, timeout):
                raise JournalError(f"frame {seq} was not durable within {timeout} s")
            outcome = self._outcome(seq)
        if isinstance(outcome, JournalError):
            raise JournalError(outcome.message)

    def _decide(self, through: int, error: JournalError | None, *, fatal: bool = False) -> None:
        ready: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None], str | None]] = []
        with self._cond:
            if error is not None:
                if through > self._decided_seq:
                    self._failures.append((self._decided_seq + 1, through, error))
                if fatal:
                    self._error = error
            self._last_batch_failed = error is not None
            self._decided_seq = through
            while self._waiters and (self._error is not None or self._waiters[0][0] <= through):
                seq, _, loop, future = heapq.heappop(self._waiters)
                outcome = self._outcome(seq)
                failed = outcome if isinstance(outcome, JournalError) else None
                ready.append((loop, future, failed.message if failed else None))
            self._cond.notify_all()
        for loop, future, message in ready:
            with contextlib.suppress(RuntimeError):  # the waiter's loop has closed
                loop.call_soon_threadsafe(_settle, future, message)

    # -- the committer thread --------------------------------------------------------------
    def _run(self) -> None:
        name_thread("ts-journal")
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    if self._dirty_since is None:
                        self._cond.wait()
                        continue
                    left = self._dirty_since + self._interval_s - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                batch, self._pending, self._pending_bytes = self._pending, [], 0
                closing = self._closing
            if batch:
                self._commit_batch(batch)
            dirty = self._dirty_since
            if dirty is not None and (closing or time.monotonic() - dirty >= self._interval_s):
                self._sync_written()
            if closing and not batch:
                return

    def _sync_written(self) -> None:
        """`interval`: fsync what was written since the last fsync."""
        self._dirty_since = None
        try:
            os.fsync(self._fd)
        except OSError as exc:
            self._decide(self._decided_seq, _journal_error("fsync", exc), fatal=True)

    def _commit_batch(self, batch: list[_Pending]) -> None:
        i = 0
        while i < len(batch):
            if self._error is not None:
                self._decide(batch[-1][0], self._error)
                return
            try:
                first = HEADER_BYTES + len(batch[i][2])
                if self._fd < 0 or (
                    self._active_size and self._active_size + first > self._segment_bytes
                ):
                    self._roll(batch[i][0])
            except OSError as exc:
                self._decide(batch[-1][0], _journal_error("open a segment", exc))
                return
            frames: list[bytes] = []
            size, j = self._active_size, i
            while j < len(batch):
                seq, kind, payload = batch[j]
                if frames and size + HEADER_BYTES + len(payload) > self._segment_bytes:
                    break
                frames.append(encode_frame(seq, kind, payload))
                size += HEADER_BYTES + len(payload)
                j += 1
            if not self._write(b"".join(frames), batch[-1][0]):
                return
            self._decide(batch[j - 1][0], None)
            i = j

    def _write(self, data: bytes, batch_end: int) -> bool:
        start = self._active_size
        try:
            _write_all(self._fd, data)
        except OSError as exc:
            error = _journal_error("write", exc)
            try:
                os.ftruncate(self._fd, start)
            except OSError as trunc_exc:
                self._decide(batch_end, _journal_error("truncate", trunc_exc), fatal=True)
                return False
            self._decide(batch_end, error)
            return False
        self._active_size = start + len(data)
        if self._sync_each:
            try:
                os.fsync(self._fd)
            except OSError as exc:
                self._decide(batch_end, _journal_error("fsync", exc), fatal=True)
                return False
        elif self._sync and self._dirty_since is None:
            self._dirty_since = time.monotonic()
        return True

    def _roll(self, segment_id: int) -> None:
        if self._fd >= 0 and self._dirty_since is not None:
            self._dirty_since = None
            try:
                os.fsync(self._fd)  # the old segment's tail, before its descriptor goes
            except OSError as exc:
                self._decide(self._decided_seq, _journal_error("fsync", exc), fatal=True)
                raise
        with self._seg_lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd, self._active = -1, None
            path = self.directory / segment_name(segment_id)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
            self._fd = os.open(path, flags, OUTPUT_FILE_MODE)
            self._active, self._active_size = segment_id, 0
            self._segment_ids.append(segment_id)
        if self._sync:
            try:
                fsync_path(self.directory)
            except OSError as exc:
                self._decide(self._decided_seq, _journal_error("fsync", exc), fatal=True)
                raise

    # -- segments --------------------------------------------------------------------------
    def segments(self) -> list[SegmentInfo]:
        """The journal's segments, oldest first."""
        with self._seg_lock:
            ids, active = list(self._segment_ids), self._active
        infos = []
        for n, segment_id in enumerate(ids):
            path = self.directory / segment_name(segment_id)
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                continue
            end = ids[n + 1] if n + 1 < len(ids) else None
            infos.append(SegmentInfo(segment_id, path, size, end, segment_id == active))
        return infos

    def frames(self) -> Iterator[Frame]:
        """The frames on disk at open (repaired), in order; appends go to newer segments."""
        paths = [(s, self.directory / segment_name(s)) for s in self._opened_ids]
        return _read_segments([(s, path) for s, path in paths if path.exists()])

    def remove_through(self, segment_id: int) -> int:
        """Delete every segment whose id is <= `segment_id` (their records are published
        elsewhere); the active segment cannot be removed. Returns how many were deleted."""
        with self._seg_lock:
            if self._active is not None and segment_id >= self._active:
                raise ValueError(f"segment {self._active} is still being appended to")
            doomed = [s for s in self._segment_ids if s <= segment_id]
            for s in doomed:
                with contextlib.suppress(FileNotFoundError):
                    (self.directory / segment_name(s)).unlink()
            self._segment_ids = [s for s in self._segment_ids if s > segment_id]
            self._opened_ids = [s for s in self._opened_ids if s > segment_id]
        if doomed and self._sync:
            fsync_path(self.directory)
        return len(doomed)

    # -- shutdown --------------------------------------------------------------------------
    def close(self) -> None:
        """Commit everything queued, then release the files (blocks: off the event loop)."""
        with self._cond:
            if self._closed:
                return
            self._closed = self._closing = True
            self._cond.notify_all()
        self._thread.join()
        with self._seg_lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd, self._active = -1, None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> FileJournal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _journal_error(what: str, exc: OSError) -> JournalError:
    reason = "the disk is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else str(exc)
    return JournalError(f"journal {what} failed: {reason}")


def _settle(future: asyncio.Future[None], message: str | None) -> None:
    if future.done():
        return
    if message is None:
        future.set_result(None)
    else:
        future.set_exception(JournalError(message))
