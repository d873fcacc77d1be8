"""Following an output directory as the proxy publishes shards; complete GRPO groups.

``ShardFollower`` yields ``TrainSample``s from the published ``samples`` shards of one or
more output directories, local or on any ``pyarrow.fs`` filesystem (``s3://...``,
``gs://...``, ``file://...``). Only published shards are read: the proxy stages files under
``.tmp/`` and renames them to ``part-*.parquet`` when complete, and the follower lists only
that pattern. With ``follow=True`` it polls for new shards until stopped or idle.

Its ``position`` (the shards read to the end, and the row reached in the current one) is a
plain JSON-able dict: save it with a checkpoint and pass it back to resume exactly where
training stopped, without repeating or skipping a sample.

Filters: rollout status, a policy-version range, and staleness: with ``max_staleness``,
``stale="drop"`` drops (and counts) a sample whose oldest turn is more than that many
versions behind ``current_version()``, and ``stale="mask"`` takes only the tokens that old
out of the loss (``mask_stale_tokens``), dropping a sample with none left.
``split_versions=True`` first makes one sample per behaviour version of a sample that
straddled a weight update (``split_at_version_changes``); the position then counts the
pieces of a row already handed out, so a resume repeats and skips none.

``GroupCollector`` holds samples back until a GRPO group is complete (``group_size``
distinct rollouts). ``ShardIterableDataset`` (in ``turnstile.train.torchdata``) wraps a
follower as a ``torch.utils.data.IterableDataset``. Numpy and pyarrow only.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from turnstile.output.schema import META_SCHEMA_VERSION, META_TABLE, SCHEMA_VERSION
from turnstile.output.shards import SHARD_PREFIX, SHARD_SUFFIX
from turnstile.reader import check_shard, open_uri, read_manifests
from turnstile.train.batches import (
    SAMPLE_COLUMNS,
    TrainSample,
    mask_stale_tokens,
    samples_from_batch,
    split_at_version_changes,
)

# How often a following reader lists the directories for new shards. The proxy publishes
# at least every `shard_max_age_s` (30 s by default), so one second adds little latency
# while costing one directory listing per second.
DEFAULT_POLL_INTERVAL_S: Final[float] = 1.0
# Rows read from a shard at a time: bounds memory for large shards.
READ_BATCH_ROWS: Final[int] = 1024


@dataclass
class Position:
    """Where a follower is: shards read to the end, the row reached in the current one,
    and (with ``split_versions``) the pieces of that row already handed out."""

    done: set[str] = field(default_factory=set)
    shard: str | None = None
    row: int = 0
    piece: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "done": sorted(self.done),
            "shard": self.shard,
            "row": self.row,
            "piece": self.piece,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Position:
        if not data:
            return cls()
        return cls(
            set(data.get("done", [])),
            data.get("shard"),
            int(data.get("row", 0)),
            int(data.get("piece", 0)),
        )


@dataclass
class FollowStats:
    """Counts of what a follower read and dropped."""

    shards: int = 0
    samples: int = 0
    dropped_status: int = 0
    dropped_version: int = 0
    dropped_stale: int = 0
    masked_stale_tokens: int = 0  # with stale="mask"
    split_samples: int = 0  # with split_versions: samples cut into one piece per version


def _filesystem(root: str | Path) -> tuple[pafs.FileSystem, str, bool]:
    """The filesystem and root of an output, and whether it is an object store (read
    through its writers' manifests, as `turnstile.reader` does) or a local directory."""
    text = str(root)
    if "://" in text and not text.startswith("file://"):
        fs, path = open_uri(text)
        return fs, path, True
    return pafs.LocalFileSystem(), str(Path(text.removeprefix("file://")).resolve()), False


class ShardFollower:
    """Iterate training samples from published shards, optionally following new ones."""

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        *,
        statuses: Iterable[str] | None = ("finished",),
        policy_version_min: int | None = None,
        policy_version_max: int | None = None,
        max_staleness: int | None = None,
        current_version: Callable[[], int] | None = None,
        stale: Literal["drop", "mask"] = "drop",
        split_versions: bool = False,
        follow: bool = False,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        idle_timeout_s: float | None = None,
        position: Position | dict[str, Any] | None = None,
        shard_filter: Callable[[str], bool] | None = None,
    ) -> None:
        roots = [paths] if isinstance(paths, (str, Path)) else list(paths)
        if not roots:
            raise ValueError("no output directory given")
        if max_staleness is not None and current_version is None:
            raise ValueError("max_staleness needs current_version")
        if stale not in ("drop", "mask"):
            raise ValueError(f"stale must be 'drop' or 'mask', not {stale!r}")
        self._roots = [_filesystem(r) for r in roots]
        self.statuses = None if statuses is None else frozenset(statuses)
        self.policy_version_min = policy_version_min
        self.policy_version_max = policy_version_max
        self.max_staleness = max_staleness
        self.current_version = current_version
        self.stale = stale
        self.split_versions = split_versions
        self.follow = follow
        self.poll_interval_s = poll_interval_s
        self.idle_timeout_s = idle_timeout_s
        self.shard_filter = shard_filter
        self.position = position if isinstance(position, Position) else Position.from_dict(position)
        self.stats = FollowStats()
        self._stop = threading.Event()

    def stop(self) -> None:
        """Make a following iteration end after the current shard."""
        self._stop.set()

    def pending_shards(self) -> list[tuple[pafs.FileSystem, str, str]]:
        """Published ``samples`` shards not yet read to the end, oldest first."""
        found: list[tuple[pafs.FileSystem, str, str]] = []
        for fs, root, remote in self._roots:
            for name in _published_names(fs, root, remote):
                key = f"{root}/samples/{name}"
                if key in self.position.done:
                    continue
                if self.shard_filter is not None and not self.shard_filter(key):
                    continue
                found.append((fs, key, key))
        found.sort(key=lambda item: (Path(item[2]).name, item[2]))
        return found

    def _keep(self, s: TrainSample) -> bool:
        if self.statuses is not None and s.rollout_status not in self.statuses:
            self.stats.dropped_status += 1
            return False
        low, high = s.min_policy_version, s.max_policy_version
        too_old = self.policy_version_min is not None and (
            low is None or low < self.policy_version_min
        )
        too_new = self.policy_version_max is not None and (
            high is None or high > self.policy_version_max
        )
        if too_old or too_new:
            self.stats.dropped_version += 1
            return False
        if self.max_staleness is not None and self.current_version is not None:
            current = self.current_version()
            if self.stale == "mask":
                if s.num_loss_tokens:
                    self.stats.masked_stale_tokens += mask_stale_tokens(
                        [s], current, self.max_staleness
                    )
                    if not s.num_loss_tokens:
                        self.stats.dropped_stale += 1
                        return False
            elif s.staleness(current) > self.max_staleness:
                self.stats.dropped_stale += 1
                return False
        return True

    def _pieces(self, sample: TrainSample) -> list[TrainSample]:
        if not self.split_versions:
            return [sample]
        pieces = split_at_version_changes(sample)
        if len(pieces) > 1:
            self.stats.split_samples += 1
        return pieces

    def _read_shard(self, fs: pafs.FileSystem, path: str, key: str) -> Iterator[TrainSample]:
        with fs.open_input_file(path) as handle:
            parquet = pq.ParquetFile(handle)
            _check_metadata(parquet, key)
            resuming = self.position.shard == key
            start = self.position.row if resuming else 0
            skip_pieces = self.position.piece if resuming else 0
            self.position.shard, self.position.row, self.position.piece = key, start, 0
            row = 0
            for batch in parquet.iter_batches(
                batch_size=READ_BATCH_ROWS, columns=list(SAMPLE_COLUMNS)
            ):
                if row + batch.num_rows <= start:
                    row += batch.num_rows
                    continue
                skip = max(0, start - row)
                row += batch.num_rows
                for i, sample in enumerate(samples_from_batch(batch.slice(skip))):
                    index = row - batch.num_rows + skip + i
                    pieces = self._pieces(sample)
                    done = skip_pieces if index == start else 0
                    for j in range(done, len(pieces)):
                        # The position moves past a piece (the last: past its row)
                        # before it is handed out.
                        last = j == len(pieces) - 1
                        self.position.row = index + 1 if last else index
                        self.position.piece = 0 if last else j + 1
                        if self._keep(pieces[j]):
                            self.stats.samples += 1
                            yield pieces[j]
        self.position.done.add(key)
        self.position.shard, self.position.row, self.position.piece = None, 0, 0
        self.stats.shards += 1

    def __iter__(self) -> Iterator[TrainSample]:
        idle_since = time.monotonic()
        while not self._stop.is_set():
            pending = self.pending_shards()
            for fs, path, key in pending:
                yield from self._read_shard(fs, path, key)
                if self._stop.is_set():
                    return
            if pending:
                idle_since = time.monotonic()
            if not self.follow:
                return
            if self.idle_timeout_s is not None and (
                time.monotonic() - idle_since >= self.idle_timeout_s
            ):
                return
            self._stop.wait(self.poll_interval_s)


def _published_names(fs: pafs.FileSystem, root: str, remote: bool) -> list[str]:
    """The published ``samples`` shards of one output: in an object store those its
    writers' manifests commit (never an upload not yet committed), locally the listing."""
    if remote:
        return sorted(
            {
                entry["name"]
                for manifest in read_manifests(fs, root)
                for entry in manifest.get("shards", ())
                if entry.get("table") == "samples"
            }
        )
    selector = pafs.FileSelector(f"{root}/samples", allow_not_found=True)
    return [
        info.base_name
        for info in fs.get_file_info(selector)
        if info.type == pafs.FileType.File
        and info.base_name.startswith(SHARD_PREFIX)
        and info.base_name.endswith(SHARD_SUFFIX)
    ]


def _check_metadata(parquet: pq.ParquetFile, key: str) -> None:
    raw = parquet.schema_arrow.metadata or {}
    meta = {k.decode(): v.decode() for k, v in raw.items()}
    if meta.get(META_TABLE) != "samples" or meta.get(META_SCHEMA_VERSION) != str(SCHEMA_VERSION):
        # Re-check through the reader for its precise error message on local files.
        if "://" not in key:
            check_shard(Path(key), "samples")
        raise ValueError(f"{key}: not a samples shard of schema version {SCHEMA_VERSION}")


def worker_shard_filter(worker_id: int, num_workers: int) -> Callable[[str], bool]:
    """A ``shard_filter`` giving each of ``num_workers`` readers a disjoint set of shards."""

    def keep(key: str) -> bool:
        return zlib.crc32(Path(key).name.encode()) % num_workers == worker_id

    return keep


class GroupCollector:
    """Hold samples back until their GRPO group has ``group_size`` distinct rollouts.

    ``add`` returns the complete groups (lists of samples, in arrival order) that the new
    sample finished. Samples without a group id are a group of one. At most
    ``max_open_groups`` incomplete groups are held; beyond that the oldest is dropped and
    counted in ``dropped_groups`` (a group whose rollouts never all finish would otherwise
    be held forever).
    """

    def __init__(self, group_size: int, max_open_groups: int = 10_000) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be at least 1, not {group_size}")
        self.group_size = group_size
        self.max_open_groups = max_open_groups
        self._open: OrderedDict[str, list[TrainSample]] = OrderedDict()
        self.dropped_groups = 0

    def add(self, sample: TrainSample) -> list[list[TrainSample]]:
        if sample.group_id is None:
            return [[sample]] if self.group_size == 1 else []
        members = self._open.setdefault(sample.group_id, [])
        members.append(sample)
        if len({s.rollout_id for s in members}) >= self.group_size:
            del self._open[sample.group_id]
            return [members]
        while len(self._open) > self.max_open_groups:
            self._open.popitem(last=False)
            self.dropped_groups += 1
        return []

    @property
    def open_groups(self) -> int:
        return len(self._open)


def iter_groups(samples: Iterable[TrainSample], group_size: int) -> Iterator[list[TrainSample]]:
    """Complete groups of ``group_size`` rollouts from a stream of samples."""
    collector = GroupCollector(group_size)
    for s in samples:
        yield from collector.add(s)


def iter_group_batches(
    samples: Iterable[TrainSample], group_size: int, groups_per_batch: int
) -> Iterator[list[TrainSample]]:
    """Batches of ``groups_per_batch`` complete groups (a GRPO step's worth of samples)."""
    batch: list[TrainSample] = []
    count = 0
    for group in iter_groups(samples, group_size):
        batch.extend(group)
        count += 1
        if count == groups_per_batch:
            yield batch
            batch, count = [], 0
