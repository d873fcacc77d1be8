"""Publishing shards to an object store (`--output s3://bucket/prefix`, or any pyarrow
or fsspec filesystem URI).

The journal and the shard writer stay on local disk: `ParquetShardSink` publishes each
shard into the local staging directory exactly as without a store, so a store outage
never blocks the proxy or loses a record. `ObjectStorePublisher` (one background thread)
then moves published shards to the store, in two steps per pass:

1. upload every staged shard as `<root>/<table>/<name>` (one object each);
2. commit them by rewriting this writer's manifest `<root>/_manifests/<writer_id>.json`
   (one object PUT: readers see the old list or the new one, never half of it).

Only then are the local copies removed. A failed step is retried `MAX_ATTEMPTS` times
with exponential back-off; after that the pass gives up and the next pass (every
`SCAN_INTERVAL_S`) starts again, so an outage of any length only delays publication.
Re-uploading a shard after a crash between the steps rewrites the same bytes under
the same name, and a shard uploaded but not in any manifest is invisible to readers.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs

from turnstile.output.schema import ALL_TABLES
from turnstile.output.shards import SHARD_GLOB, SinkError
from turnstile.reader import MANIFEST_DIR, MANIFEST_SUFFIX, MANIFEST_VERSION, open_uri

log = logging.getLogger("turnstile.objstore")

# A connection to a store in the same region opens in milliseconds; 5 s covers a slow
# TLS handshake without hiding an outage.
S3_CONNECT_TIMEOUT_S: Final[float] = 5.0
# One request moves at most one shard (tens of MiB): a minute is ample on any working
# link and bounds how long an attempt can hang on a dead one.
S3_REQUEST_TIMEOUT_S: Final[float] = 60.0
# The S3 client's own retries inside one attempt; Turnstile retries around it.
S3_CLIENT_ATTEMPTS: Final[int] = 2
# Attempts per step and pass, waiting BACKOFF_INITIAL_S, doubling up to BACKOFF_MAX_S
# (about a minute in all) before the pass gives up and the files wait for the next.
MAX_ATTEMPTS: Final[int] = 8
BACKOFF_INITIAL_S: Final[float] = 0.25
BACKOFF_MAX_S: Final[float] = 15.0
# How often the staging directory is looked at for newly published shards; shards are
# published every few seconds at most (`shard_max_age_s`), so this adds little delay.
SCAN_INTERVAL_S: Final[float] = 1.0
# At shutdown, how long the last pass may take before staged shards are left for the
# next start (they are not lost: they stay on local disk).
DRAIN_TIMEOUT_S: Final[float] = 60.0
_COPY_CHUNK_BYTES: Final[int] = 8 * 1024 * 1024

T = TypeVar("T")


class ObjectStoreError(SinkError):
    """The object store could not be written after all attempts of a pass."""


def open_store(
    uri: str, *, endpoint: str | None = None, region: str | None = None
) -> tuple[pafs.FileSystem, str]:
    """The filesystem and root path for `uri`; `s3://` gets Turnstile's timeouts.

    S3 credentials come from the standard AWS variables (`AWS_ACCESS_KEY_ID`,
    `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`) or the instance role; never from
    settings.
    """
    if uri.startswith("s3://"):
        try:
            fs = pafs.S3FileSystem(
                endpoint_override=endpoint,
                region=region or "us-east-1",
                connect_timeout=S3_CONNECT_TIMEOUT_S,
                request_timeout=S3_REQUEST_TIMEOUT_S,
                retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=S3_CLIENT_ATTEMPTS),
            )
        except (pa.ArrowException, OSError) as e:
            raise ObjectStoreError(f"cannot open the S3 store for {uri}: {e}") from e
        return fs, uri.removeprefix("s3://").rstrip("/")
    try:
        return open_uri(uri)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise ObjectStoreError(f"cannot open the object store {uri}: {e}") from e


@dataclass(slots=True)
class PublisherStats:
    uploaded: int = 0  # shards committed to the store
    attempts_failed: int = 0  # failed attempts (each retried)
    passes_failed: int = 0  # passes that gave up after MAX_ATTEMPTS
    last_error: str | None = None


class ObjectStorePublisher:
    """Moves shards from the local staging directory to the store (one thread)."""

    def __init__(
        self,
        staging: Path,
        fs: pafs.FileSystem,
        root: str,
        *,
        writer_id: str,
        scan_interval_s: float = SCAN_INTERVAL_S,
        backoff_initial_s: float = BACKOFF_INITIAL_S,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.staging = staging
        self.fs = fs
        self.root = root
        self.writer_id = writer_id
        self.scan_interval_s = scan_interval_s
        self.backoff_initial_s = backoff_initial_s
        self._sleep = sleep
        self.stats = PublisherStats()
        self._entries: dict[str, dict[str, Any]] | None = None  # committed, by table/name
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._deadline: float | None = None

    @property
    def manifest_path(self) -> str:
        return f"{self.root}/{MANIFEST_DIR}/{self.writer_id}{MANIFEST_SUFFIX}"

    # -- one pass ----------------------------------------------------------------------
    def staged(self) -> list[tuple[str, Path]]:
        """Published local shards not yet moved to the store, oldest first."""
        found = [
            (table, p) for table in ALL_TABLES for p in (self.staging / table).glob(SHARD_GLOB)
        ]
        return sorted(found, key=lambda tp: tp[1].name)

    def sync_once(self) -> int:
        """Upload and commit every staged shard; the number committed.

        Raises ObjectStoreError when a step fails MAX_ATTEMPTS times (nothing staged is
        removed then).
        """
        if self._entries is None:
            self._entries = self._retry("read the manifest", self._load_manifest)
        staged = self.staged()
        if not staged:
            return 0
        entries = dict(self._entries)
        for table, path in staged:
            key = f"{table}/{path.name}"
            size = self._retry(f"upload {key}", functools.partial(self._upload, table, path))
            entries[key] = {"table": table, "name": path.name, "bytes": size}
        self._retry("commit the manifest", lambda: self._write_manifest(entries))
        self._entries = entries
        for _, path in staged:
            path.unlink(missing_ok=True)
        self.stats.uploaded += len(staged)
        log.info("committed %d shards to %s", len(staged), self.manifest_path)
        return len(staged)

    def _retry(self, what: str, op: Callable[[], T]) -> T:
        delay = self.backoff_initial_s
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                return op()
            except (OSError, pa.ArrowException) as e:
                self.stats.attempts_failed += 1
                self.stats.last_error = f"{what}: {e}"
                out_of_time = self._deadline is not None and time.monotonic() >= self._deadline
                if attempt == MAX_ATTEMPTS or out_of_time:
                    self.stats.passes_failed += 1
                    raise ObjectStoreError(f"could not {what} in {attempt} attempts: {e}") from e
                log.warning(
                    "object store: could not %s (attempt %d of %d, retrying in %.2f s): %s",
                    what,
                    attempt,
                    MAX_ATTEMPTS,
                    delay,
                    e,
                )
                self._sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)
        raise AssertionError("unreachable")

    def _load_manifest(self) -> dict[str, dict[str, Any]]:
        info = self.fs.get_file_info(self.manifest_path)
        if info.type == pafs.FileType.NotFound:
            return {}
        with self.fs.open_input_stream(self.manifest_path) as f:
            manifest = json.loads(f.read())
        return {f"{e['table']}/{e['name']}": e for e in manifest.get("shards", ())}

    def _upload(self, table: str, path: Path) -> int:
        target = f"{self.root}/{table}/{path.name}"
        size = 0
        with path.open("rb") as src, self.fs.open_output_stream(target) as dst:
            while chunk := src.read(_COPY_CHUNK_BYTES):
                dst.write(chunk)
                size += len(chunk)
        return size

    def _write_manifest(self, entries: dict[str, dict[str, Any]]) -> None:
        manifest = {
            "manifest_version": MANIFEST_VERSION,
            "writer_id": self.writer_id,
            "updated_at": time.time(),
            "shards": sorted(entries.values(), key=lambda e: (e["name"], e["table"])),
        }
        data = json.dumps(manifest, indent=1).encode()
        if isinstance(self.fs, pafs.S3FileSystem):
            with self.fs.open_output_stream(self.manifest_path) as f:  # one atomic PUT
                f.write(data)
            return
        tmp = f"{self.root}/{MANIFEST_DIR}/.{self.writer_id}{MANIFEST_SUFFIX}.tmp"
        self.fs.create_dir(f"{self.root}/{MANIFEST_DIR}", recursive=True)
        with self.fs.open_output_stream(tmp) as f:
            f.write(data)
        self.fs.move(tmp, self.manifest_path)

    # -- the thread ------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="turnstile-objstore", daemon=True
            )
            self._thread.start()

    def poke(self) -> None:
        """Look at the staging directory now (e.g. right after a shard was published)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._pass()
            self._wake.wait(self.scan_interval_s)
            self._wake.clear()

    def _pass(self) -> None:
        try:
            self.sync_once()
        except ObjectStoreError as e:
            log.error("object store publishing paused (shards stay staged): %s", e)

    def stop(self, timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
        """Stop the thread after a last pass; whether nothing is left staged."""
        self._deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self._pass()
        left = self.staged()
        if left:
            log.warning("%d shards stay staged in %s for the next start", len(left), self.staging)
        return not left
