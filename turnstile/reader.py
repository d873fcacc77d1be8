"""Reading Turnstile output from a trainer: published shards only, version-checked.

This module imports nothing beyond pyarrow, numpy and the standard library (plus the
schema declaration), so trainers can use it without the proxy's web stack.

An output directory holds one sub-directory per table (`turns`, `samples`, `rollouts`)
of published shards named `part-*.parquet`; staged files are never listed. Several
output directories (e.g. one per proxy replica) merge into one view. Every shard's
`turnstile.schema_version` metadata is checked before it is read.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypedDict

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from turnstile.output.schema import (
    META_SCHEMA_VERSION,
    META_TABLE,
    READABLE_SCHEMA_VERSIONS,
    SCHEMA_VERSION,
    SCHEMAS,
    TABLES,
    TableName,
)

SHARD_GLOB: Final[str] = "part-*.parquet"
# In an object store, each writer (proxy replica) commits the shards it has uploaded by
# rewriting its own manifest `<root>/_manifests/<writer_id>.json`; readers see exactly
# the union of the manifests' shards, never an object whose upload is not committed.
MANIFEST_DIR: Final[str] = "_manifests"
MANIFEST_SUFFIX: Final[str] = ".json"
MANIFEST_VERSION: Final[int] = 1
# How often `ShardReader.wait_for` looks for newly published shards: well under the
# proxy's publish delay (0.5 s), and cheap (a directory listing and a filtered scan of
# the rollouts table's id columns).
WAIT_POLL_S: Final[float] = 0.1


def open_uri(uri: str) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the root path inside it for `uri` (s3://, gs://, file://,
    or any fsspec protocol when fsspec is installed)."""
    try:
        fs, root = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as e:
        try:
            import fsspec  # optional: for protocols pyarrow does not know
        except ImportError:
            raise ValueError(f"cannot open {uri}: {e} (fsspec is not installed)") from e
        spec_fs, root = fsspec.core.url_to_fs(uri)
        fs = pafs.PyFileSystem(pafs.FSSpecHandler(spec_fs))
    return fs, root.rstrip("/")


def read_manifests(fs: pafs.FileSystem, root: str) -> list[dict[str, Any]]:
    """Every writer's manifest under `root` (none yet: an empty list)."""
    selector = pafs.FileSelector(f"{root}/{MANIFEST_DIR}", allow_not_found=True)
    out = []
    for info in fs.get_file_info(selector):
        if info.type != pafs.FileType.File or not info.base_name.endswith(MANIFEST_SUFFIX):
            continue
        if info.base_name.startswith("."):
            continue
        with fs.open_input_stream(info.path) as f:
            manifest = json.loads(f.read())
        if manifest.get("manifest_version") != MANIFEST_VERSION:
            raise ShardFormatError(f"{info.path}: unknown manifest version")
        out.append(manifest)
    return out


# Which columns the policy-version and status filters apply to, per table.
_VERSION_RANGE: Final[Mapping[TableName, tuple[str, str]]] = {
    "turns": ("policy_version", "policy_version"),
    "samples": ("min_policy_version", "max_policy_version"),
    "rollouts": ("min_policy_version", "max_policy_version"),
}
_STATUS_COLUMN: Final[Mapping[TableName, str]] = {
    "turns": "status",
    "samples": "rollout_status",
    "rollouts": "status",
}
_SAMPLE_ARRAY_COLUMNS: Final[tuple[str, ...]] = (
    "rollout_id",
    "sample_index",
    "group_id",
    "task_id",
    "rollout_status",
    "input_ids",
    "loss_mask",
    "behavior_logprobs",
    "rewards",
    "reward",
    "policy_versions",
    "policy_version_spans",
    "image_spans",
)
# The version of a token that was not sampled (prompt, padding, aborted turns).
NO_VERSION: Final[int] = -1


class ShardFormatError(ValueError):
    """A file is not a Turnstile shard of the expected table."""


class SchemaVersionError(ShardFormatError):
    """A shard was written with a schema version this reader does not know."""


class SampleArrays(TypedDict):
    """One training sample as numpy arrays (each array is a fresh, writable copy)."""

    rollout_id: str
    sample_index: int
    group_id: str | None
    task_id: str | None
    rollout_status: str
    input_ids: npt.NDArray[np.int32]
    loss_mask: npt.NDArray[np.int8]
    behavior_logprobs: npt.NDArray[np.float32]
    rewards: dict[str, float]
    reward: float | None
    policy_versions: npt.NDArray[np.int64]
    # the version that sampled each token of input_ids (NO_VERSION off the loss mask)
    behavior_versions: npt.NDArray[np.int64]
    # the sample's images in order, with their placeholder spans in input_ids (the bytes:
    # `ShardReader.images`)
    images: list[ImageSpan]


class ImageSpan(TypedDict):
    """One image of a turn or sample: its hash in the `media` table (None: a remote image
    recorded by URL only), its URL (None: inline data), and where its placeholder tokens
    are (None: not located)."""

    sha256: str | None
    url: str | None
    start: int | None
    length: int | None


@dataclass(frozen=True, slots=True)
class StoredImage:
    """An image's bytes as the backend received them, from the `media` table."""

    sha256: str
    mime_type: str
    data: bytes


def rewards_dict(struct_list: pa.Scalar | Sequence[Mapping[str, Any]] | None) -> dict[str, float]:
    """`{name: value}` from a `rewards` cell (Arrow scalar or `to_pylist()` form).

    If a name occurs more than once, its last value wins.
    """
    if struct_list is None:
        return {}
    items = struct_list.as_py() if isinstance(struct_list, pa.Scalar) else struct_list
    if items is None:
        return {}
    return {str(item["name"]): float(item["value"]) for item in items}


def check_shard(
    path: Path | str, table: TableName, filesystem: pafs.FileSystem | None = None
) -> dict[str, str]:
    """The shard's Turnstile metadata, after checking its version and table."""
    try:
        raw = pq.read_schema(path, filesystem=filesystem).metadata or {}
    except (OSError, pa.ArrowInvalid) as e:
        raise ShardFormatError(f"{path}: cannot read a Parquet footer: {e}") from e
    meta = {k.decode(): v.decode() for k, v in raw.items() if k.startswith(b"turnstile.")}
    version_text = meta.get(META_SCHEMA_VERSION)
    if version_text is None:
        raise ShardFormatError(f"{path}: no {META_SCHEMA_VERSION} metadata: not a Turnstile shard")
    try:
        version = int(version_text)
    except ValueError as e:
        raise SchemaVersionError(f"{path}: unreadable schema version {version_text!r}") from e
    if version not in READABLE_SCHEMA_VERSIONS:
        newer = "a newer" if version > SCHEMA_VERSION else "an unknown"
        raise SchemaVersionError(
            f"{path}: written with {newer} schema version {version}; this reader "
            f"understands version {SCHEMA_VERSION} (upgrade turnstile to read it)"
        )
    if meta.get(META_TABLE) != table:
        raise ShardFormatError(f"{path}: holds table {meta.get(META_TABLE)!r}, not {table!r}")
    return meta


def _values(statuses: Iterable[str | enum.Enum]) -> list[str]:
    return [s.value if isinstance(s, enum.Enum) else str(s) for s in statuses]


class ShardReader:
    """A merged, read-only view of one or more Turnstile output directories."""

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        *,
        filesystem: pafs.FileSystem | None = None,
    ) -> None:
        if isinstance(paths, (str, Path)):
            paths = [paths]
        if not paths:
            raise ValueError("no output directory given")
        # Object-store roots (a URI, or any path with an explicit `filesystem`) are read
        # through their writers' manifests; local directories by listing.
        self.remotes: list[tuple[pafs.FileSystem, str]] = []
        self.roots: list[Path] = []
        for p in paths:
            if filesystem is not None:  # a path inside it (a URI's scheme is dropped)
                self.remotes.append(
                    (
                        filesystem,
                        str(p).partition("://")[2].rstrip("/")
                        if "://" in str(p)
                        else str(p).rstrip("/"),
                    )
                )
            elif isinstance(p, str) and "://" in p and not p.startswith("file://"):
                self.remotes.append(open_uri(p))
            else:
                self.roots.append(Path(p.removeprefix("file://") if isinstance(p, str) else p))
        for root in self.roots:
            if not root.is_dir():
                raise FileNotFoundError(f"Turnstile output directory {root} does not exist")
        self._checked: dict[Path, dict[str, str]] = {}
        self._remote_checked: dict[tuple[int, str], dict[str, str]] = {}

    def remote_files(self, table: TableName) -> list[tuple[pafs.FileSystem, list[str]]]:
        """Committed shards of `table` in each object-store root, version-checked."""
        out = []
        for n, (fs, root) in enumerate(self.remotes):
            names = sorted(
                {
                    entry["name"]
                    for manifest in read_manifests(fs, root)
                    for entry in manifest.get("shards", ())
                    if entry.get("table") == table
                }
            )
            paths = [f"{root}/{table}/{name}" for name in names]
            for path in paths:
                if (n, path) not in self._remote_checked:
                    self._remote_checked[(n, path)] = check_shard(path, table, fs)
            out.append((fs, paths))
        return out

    # ------------------------------------------------------------ files

    def files(self, table: TableName) -> list[Path]:
        """Published shards of `table` in all directories, oldest first, version-checked."""
        if table not in SCHEMAS:
            raise ValueError(f"unknown table {table!r}; expected one of {TABLES}")
        found = [p for root in self.roots for p in (root / table).glob(SHARD_GLOB)]
        found.sort(key=lambda p: (p.name, str(p)))
        for path in found:
            if path not in self._checked:
                self._checked[path] = check_shard(path, table)
        return found

    def metadata(self, table: TableName) -> list[dict[str, str]]:
        """The Turnstile metadata (version, model, tokenizer, writer) of each shard."""
        return [self._checked[p] for p in self.files(table)]

    def dataset(self, table: TableName) -> ds.Dataset:
        """A `pyarrow.dataset` over the published shards of `table`."""
        local = ds.dataset(
            [str(p) for p in self.files(table)], schema=SCHEMAS[table], format="parquet"
        )
        if not self.remotes:
            return local
        parts = [local] + [
            ds.dataset(paths, schema=SCHEMAS[table], format="parquet", filesystem=fs)
            for fs, paths in self.remote_files(table)
        ]
        return ds.dataset(parts)

    # ------------------------------------------------------------ tables

    def _filter(
        self,
        table: TableName,
        policy_version_min: int | None,
        policy_version_max: int | None,
        statuses: Iterable[str | enum.Enum] | None,
    ) -> pc.Expression | None:
        if policy_version_min is None and policy_version_max is None and statuses is None:
            return None
        if table not in _VERSION_RANGE:
            raise ValueError(f"the {table} table has no policy versions or statuses to filter")
        low_col, high_col = _VERSION_RANGE[table]
        terms: list[pc.Expression] = []
        if policy_version_min is not None:
            terms.append(pc.field(low_col) >= policy_version_min)
        if policy_version_max is not None:
            terms.append(pc.field(high_col) <= policy_version_max)
        if statuses is not None:
            terms.append(pc.field(_STATUS_COLUMN[table]).isin(_values(statuses)))
        if not terms:
            return None
        expression = terms[0]
        for term in terms[1:]:
            expression = expression & term
        return expression

    def read(
        self,
        table: TableName,
        *,
        policy_version_min: int | None = None,
        policy_version_max: int | None = None,
        statuses: Iterable[str | enum.Enum] | None = None,
        columns: Sequence[str] | None = None,
    ) -> pa.Table:
        """Rows of `table` matching the filters (see `samples` for their meaning)."""
        expression = self._filter(table, policy_version_min, policy_version_max, statuses)
        cols = list(columns) if columns is not None else None
        return self.dataset(table).to_table(columns=cols, filter=expression)

    def samples(
        self,
        policy_version_min: int | None = None,
        policy_version_max: int | None = None,
        statuses: Iterable[str | enum.Enum] | None = None,
        columns: Sequence[str] | None = None,
    ) -> pa.Table:
        """Training samples.

        A sample matches the version range when all its turns do
        (`min_policy_version >= policy_version_min`, `max_policy_version <=
        policy_version_max`); `statuses` filters on `rollout_status`.
        """
        return self.read(
            "samples",
            policy_version_min=policy_version_min,
            policy_version_max=policy_version_max,
            statuses=statuses,
            columns=columns,
        )

    def turns(
        self,
        policy_version_min: int | None = None,
        policy_version_max: int | None = None,
        statuses: Iterable[str | enum.Enum] | None = None,
        columns: Sequence[str] | None = None,
    ) -> pa.Table:
        """Recorded turns, filtered on `policy_version` and the turn `status`."""
        return self.read(
            "turns",
            policy_version_min=policy_version_min,
            policy_version_max=policy_version_max,
            statuses=statuses,
            columns=columns,
        )

    def rollouts(
        self,
        policy_version_min: int | None = None,
        policy_version_max: int | None = None,
        statuses: Iterable[str | enum.Enum] | None = None,
        columns: Sequence[str] | None = None,
    ) -> pa.Table:
        """Rollout summaries, filtered on their policy version range and `status`."""
        return self.read(
            "rollouts",
            policy_version_min=policy_version_min,
            policy_version_max=policy_version_max,
            statuses=statuses,
            columns=columns,
        )

    def wait_for(
        self,
        rollout_ids: Iterable[str] = (),
        group_ids: Iterable[str] = (),
        *,
        timeout_s: float,
        poll_s: float = WAIT_POLL_S,
    ) -> pa.Table:
        """The samples of these rollouts and of every rollout of these groups, once all
        are published; `TimeoutError` (naming what is missing) after `timeout_s`.

        A group is complete when as many of its rollouts are published as it declared
        (`group_size` in `POST /rollouts`); a group that declared no size is complete
        with its first published rollout. The proxy publishes a finished rollout, or the
        last of a group, within its `publish_delay_s` (0.5 s by default).
        """
        wanted, groups = set(rollout_ids), set(group_ids)
        if not wanted and not groups:
            raise ValueError("name at least one rollout id or group id")
        deadline = time.monotonic() + timeout_s
        while True:
            found, missing = self._published(wanted, groups)
            if not missing:
                return self.dataset("samples").to_table(
                    filter=pc.field("rollout_id").isin(sorted(found))
                )
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"not published within {timeout_s} s: {', '.join(sorted(missing))}"
                )
            time.sleep(poll_s)

    def _published(self, wanted: set[str], groups: set[str]) -> tuple[set[str], set[str]]:
        """Rollout ids published among `wanted` and `groups`, and what is still missing
        (`rollout X`, `group G (n of N)`)."""
        terms = []
        if wanted:
            terms.append(pc.field("rollout_id").isin(sorted(wanted)))
        if groups:
            terms.append(pc.field("group_id").isin(sorted(groups)))
        expression = terms[0] if len(terms) == 1 else terms[0] | terms[1]
        rows = (
            self.dataset("rollouts")
            .to_table(columns=["rollout_id", "group_id", "group_size"], filter=expression)
            .to_pylist()
        )
        found = {r["rollout_id"] for r in rows}
        missing = {f"rollout {rid}" for rid in wanted - found}
        for group in groups:
            members = [r for r in rows if r["group_id"] == group]
            sizes = [r["group_size"] for r in members if r["group_size"] is not None]
            size = max(sizes) if sizes else None
            if not members or (size is not None and len(members) < size):
                missing.add(f"group {group} ({len(members)} of {size or '?'})")
        return found, missing

    def quarantine(self, columns: Sequence[str] | None = None) -> pa.Table:
        """Rows that could not be written to their table, with the reason and the record
        (`turnstile.output.quarantine`); empty when nothing was quarantined."""
        cols = list(columns) if columns is not None else None
        return self.dataset("quarantine").to_table(columns=cols)

    # ------------------------------------------------------------ iteration

    def images(self, sha256s: Iterable[str | None]) -> dict[str, StoredImage]:
        """The stored images with these hashes (each read once; None entries, remote
        images recorded by URL only, are skipped). `KeyError` names any hash that no
        published media shard holds."""
        wanted = sorted({h for h in sha256s if h is not None})
        if not wanted:
            return {}
        table = self.dataset("media").to_table(
            columns=["sha256", "mime_type", "data"], filter=pc.field("sha256").isin(wanted)
        )
        found: dict[str, StoredImage] = {}
        for sha, mime, data in zip(
            table.column("sha256").to_pylist(),
            table.column("mime_type").to_pylist(),
            table.column("data").to_pylist(),
            strict=True,
        ):
            found.setdefault(sha, StoredImage(sha, mime, data))
        missing = [h for h in wanted if h not in found]
        if missing:
            raise KeyError(f"no published media shard holds image {missing[0]}")
        return found

    def sample_images(self, sample: SampleArrays) -> list[tuple[ImageSpan, StoredImage | None]]:
        """A sample's images in order, each with its bytes (None for a remote image
        recorded by URL only)."""
        stored = self.images(i["sha256"] for i in sample["images"])
        return [(i, None if i["sha256"] is None else stored[i["sha256"]]) for i in sample["images"]]

    def iter_batches(
        self,
        table: TableName,
        batch_size: int,
        *,
        policy_version_min: int | None = None,
        policy_version_max: int | None = None,
        statuses: Iterable[str | enum.Enum] | None = None,
        columns: Sequence[str] | None = None,
    ) -> Iterator[pa.RecordBatch]:
        """Matching rows in batches of exactly `batch_size` rows (the last may be short)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        expression = self._filter(table, policy_version_min, policy_version_max, statuses)
        cols = list(columns) if columns is not None else None
        pending: list[pa.RecordBatch] = []
        pending_rows = 0
        for batch in self.dataset(table).to_batches(
            columns=cols, filter=expression, batch_size=batch_size
        ):
            if batch.num_rows == 0:
                continue
            pending.append(batch)
            pending_rows += batch.num_rows
            if pending_rows < batch_size:
                continue
            merged = pa.Table.from_batches(pending).combine_chunks()
            start = 0
            while merged.num_rows - start >= batch_size:
                yield merged.slice(start, batch_size).to_batches()[0]
                start += batch_size
            rest = merged.slice(start)
            pending = rest.to_batches() if rest.num_rows else []
            pending_rows = rest.num_rows
        if pending_rows:
            yield pa.Table.from_batches(pending).combine_chunks().to_batches()[0]

    def iter_sample_batches(
        self,
        batch_size: int,
        policy_version_min: int | None = None,
        policy_version_max: int | None = None,
        statuses: Iterable[str | enum.Enum] | None = None,
        columns: Sequence[str] | None = None,
    ) -> Iterator[pa.RecordBatch]:
        """Samples in record batches of `batch_size` rows, filtered as in `samples`."""
        return self.iter_batches(
            "samples",
            batch_size,
            policy_version_min=policy_version_min,
            policy_version_max=policy_version_max,
            statuses=statuses,
            columns=columns,
        )

    def sample_arrays(
        self,
        policy_version_min: int | None = None,
        policy_version_max: int | None = None,
        statuses: Iterable[str | enum.Enum] | None = None,
        batch_size: int = 1024,
    ) -> Iterator[SampleArrays]:
        """Each matching sample as numpy arrays plus its rewards and identifiers."""
        for batch in self.iter_batches(
            "samples",
            batch_size,
            policy_version_min=policy_version_min,
            policy_version_max=policy_version_max,
            statuses=statuses,
            columns=_SAMPLE_ARRAY_COLUMNS,
        ):
            yield from _batch_arrays(batch)


def list_parts(
    column: pa.Array | pa.ChunkedArray, dtype: type[np.generic]
) -> tuple[npt.NDArray[Any], npt.NDArray[np.int32]]:
    """A list column's flat values and absolute offsets into them."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    assert isinstance(column, pa.ListArray)
    values = np.asarray(column.values.to_numpy(zero_copy_only=False), dtype=dtype)
    offsets = column.offsets.to_numpy()
    return values, offsets


def spread_versions(
    spans: Sequence[Mapping[str, int]] | None, loss_mask: npt.NDArray[np.int8]
) -> npt.NDArray[np.int64] | None:
    """Per-token versions from a sample's ``policy_version_spans`` (``start``, ``version``
    runs over ``input_ids``): each sampled token gets the run it falls in, the others
    ``NO_VERSION``. None when the sample has none (shards before version 4, samples made
    without them): its sampled tokens then carry ``min_policy_version``."""
    if not spans:
        return None
    out = np.full(loss_mask.shape[0], NO_VERSION, dtype=np.int64)
    starts = np.array([int(x["start"]) for x in spans], dtype=np.int64)
    versions = np.array([int(x["version"]) for x in spans], dtype=np.int64)
    positions = np.arange(loss_mask.shape[0])
    run = np.searchsorted(starts, positions, side="right") - 1
    sampled = (loss_mask > 0) & (run >= 0)
    out[sampled] = versions[run[sampled]]
    return out


def sample_arrays_of(samples: pa.Table) -> Iterator[SampleArrays]:
    """Each row of a `samples` table (as `ShardReader.wait_for` returns) as numpy arrays
    plus its rewards and identifiers, like `ShardReader.sample_arrays`."""
    for batch in samples.select(list(_SAMPLE_ARRAY_COLUMNS)).to_batches():
        yield from _batch_arrays(batch)


def _batch_arrays(batch: pa.RecordBatch) -> Iterator[SampleArrays]:
    ids, ids_off = list_parts(batch.column("input_ids"), np.int32)
    mask, mask_off = list_parts(batch.column("loss_mask"), np.int8)
    logp, logp_off = list_parts(batch.column("behavior_logprobs"), np.float32)
    vers, vers_off = list_parts(batch.column("policy_versions"), np.int64)
    rollout_ids = batch.column("rollout_id").to_pylist()
    indices = batch.column("sample_index").to_pylist()
    groups = batch.column("group_id").to_pylist()
    tasks = batch.column("task_id").to_pylist()
    statuses = batch.column("rollout_status").to_pylist()
    rewards = batch.column("rewards").to_pylist()
    reward = batch.column("reward").to_pylist()
    spans = batch.column("policy_version_spans").to_pylist()
    images = batch.column("image_spans").to_pylist()
    for i in range(batch.num_rows):
        loss_mask = mask[mask_off[i] : mask_off[i + 1]].copy()
        versions = vers[vers_off[i] : vers_off[i + 1]].copy()
        per_token = spread_versions(spans[i], loss_mask)
        if per_token is None:  # no spans (shards before version 4): the oldest turn's
            low = int(versions.min()) if versions.size else NO_VERSION
            per_token = np.where(loss_mask > 0, low, NO_VERSION).astype(np.int64)
        yield SampleArrays(
            rollout_id=rollout_ids[i],
            sample_index=indices[i],
            group_id=groups[i],
            task_id=tasks[i],
            rollout_status=statuses[i],
            input_ids=ids[ids_off[i] : ids_off[i + 1]].copy(),
            loss_mask=loss_mask,
            behavior_logprobs=logp[logp_off[i] : logp_off[i + 1]].copy(),
            rewards=rewards_dict(rewards[i]),
            reward=reward[i],
            policy_versions=versions,
            behavior_versions=per_token,
            images=[
                ImageSpan(sha256=x["sha256"], url=x["url"], start=x["start"], length=x["length"])
                for x in images[i] or ()
            ],
        )


def open_output(
    paths: str | Path | Sequence[str | Path], *, filesystem: pafs.FileSystem | None = None
) -> ShardReader:
    """Open one or more Turnstile outputs for reading: local directories, object-store
    URIs (`s3://bucket/prefix`), or paths inside an explicit pyarrow `filesystem`."""
    return ShardReader(paths, filesystem=filesystem)
