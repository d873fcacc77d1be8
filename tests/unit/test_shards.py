"""The Parquet sink: rolling, atomic publication, naming, metadata and disk errors."""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from tests.fakes_sink import InMemorySink, make_rollout, make_sample, make_turn
from turnstile.output.schema import SCHEMA_VERSION
from turnstile.output.shards import (
    DEFAULT_MAX_AGE_S,
    DEFAULT_MAX_ROWS,
    STAGING_DIR,
    ParquetShardSink,
    Sink,
    SinkError,
)
from turnstile.reader import open_output

NAME = re.compile(r"part-(\d{13})-(.+)-(\d{6})\.parquet")


def _sink(out: Path, writer_id: str = "w1", **kwargs: Any) -> ParquetShardSink:
    options: dict[str, Any] = {"max_rows": 100, "max_age_s": 30.0, "fsync": False}
    options.update(kwargs)
    return ParquetShardSink(
        out, writer_id=writer_id, identity={"model": "m", "tokenizer": "tok"}, **options
    )


def _published(out: Path, table: str = "turns") -> list[Path]:
    return sorted((out / table).glob("part-*.parquet"))


def _strays(out: Path) -> list[Path]:
    """Everything under `out` that is neither a directory, a published shard nor a
    writer's manifest (`_manifests/<writer_id>.json`; its temp files are strays)."""
    return [
        p
        for p in out.rglob("*")
        if p.is_file()
        and not NAME.fullmatch(p.name)
        and not (
            p.parent.name == "_manifests" and p.suffix == ".json" and not p.name.startswith(".")
        )
    ]


def test_defaults_are_sane() -> None:
    assert DEFAULT_MAX_ROWS == 4096 and DEFAULT_MAX_AGE_S == 30


def test_rolls_by_rows(tmp_path: Path) -> None:
    sink = _sink(tmp_path, max_rows=3)
    sink.write_turns([make_turn("r", i) for i in range(7)])
    files = _published(tmp_path)
    assert [pq.read_metadata(f).num_rows for f in files] == [3, 3]
    assert sink.buffered("turns") == 1
    sink.flush()
    assert [pq.read_metadata(f).num_rows for f in _published(tmp_path)] == [3, 3, 1]
    assert sink.rows_published["turns"] == 7 and sink.shards_published == 3
    rows = pa.concat_tables(pq.read_table(f) for f in _published(tmp_path))
    assert rows.column("turn_index").to_pylist() == list(range(7))


def test_rolls_by_age(tmp_path: Path) -> None:
    sink = _sink(tmp_path, max_age_s=10.0)
    assert sink.seconds_until_roll() is None
    start = time.time()
    sink.write_samples([make_sample("r", 0), make_sample("r", 1)])
    sink.write_rollouts([make_rollout("r")])
    sink.maybe_roll(start + 1)
    assert _published(tmp_path, "samples") == [] and sink.buffered("samples") == 2
    remaining = sink.seconds_until_roll(start + 1)
    assert remaining is not None and 8.5 < remaining <= 9.5
    sink.maybe_roll(start + 11)
    assert len(_published(tmp_path, "samples")) == 1
    assert len(_published(tmp_path, "rollouts")) == 1
    assert sink.buffered("samples") == 0 and sink.seconds_until_roll() is None
    sink.maybe_roll(start + 100)
    assert len(_published(tmp_path, "samples")) == 1


def test_publication_leaves_no_temp_files(tmp_path: Path) -> None:
    sink = _sink(tmp_path, fsync=True)
    sink.write_turns([make_turn()])
    sink.write_samples([make_sample()])
    sink.flush()
    sink.write_rollouts([make_rollout()])
    sink.close()
    assert _strays(tmp_path) == []
    assert list((tmp_path / ".tmp").iterdir()) == []
    for table in ("turns", "samples", "rollouts"):
        assert len(_published(tmp_path, table)) == 1
    with pytest.raises(SinkError, match="closed"):
        sink.write_turns([make_turn()])
    sink.close()


def test_crash_leftovers_are_ignored_and_cleaned(tmp_path: Path) -> None:
    sink = _sink(tmp_path)
    sink.write_samples([make_sample()])
    sink.close()
    staged_own = tmp_path / ".tmp" / "samples-part-1700000000000-w1-000007.parquet.partial"
    staged_other = tmp_path / ".tmp" / "samples-part-1700000000000-w2-000001.parquet.partial"
    dotted = tmp_path / "samples" / ".tmp-part-1700000000000-w1-000008.parquet"
    for path in (staged_own, staged_other, dotted):
        path.write_bytes(b"PAR1 half a shard")

    assert open_output(tmp_path).samples().num_rows == 1
    assert ds.dataset(tmp_path / "samples", format="parquet").to_table().num_rows == 1

    _sink(tmp_path, writer_id="w1").close()  # a restarted writer cleans only its own
    assert not staged_own.exists() and staged_other.exists()


def test_names_are_unique_and_sort_by_time_across_writers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ticks: Iterator[int] = itertools.count(1_700_000_000_000_000_000, 400_000)  # 0.4 ms
    monkeypatch.setattr(time, "time_ns", lambda: next(ticks))
    first, second = _sink(tmp_path, "alpha"), _sink(tmp_path, "beta-2.node")
    order: list[str] = []
    for i in range(12):
        sink = first if i % 3 else second
        sink.write_turns([make_turn("r", i)])
        sink.flush()
        (new,) = set(p.name for p in _published(tmp_path)) - set(order)
        order.append(new)
    assert len(set(order)) == 12
    parsed = [NAME.fullmatch(n) for n in order]
    stamps = [int(m[1]) for m in parsed if m]
    assert stamps == sorted(stamps)  # publication order is time order
    by_name = [int(m[1]) for m in map(NAME.fullmatch, sorted(order)) if m]
    assert by_name == sorted(by_name)  # sorting names sorts by time
    for writer in ("alpha", "beta-2.node"):
        own = [n for n, m in zip(order, parsed, strict=True) if m and m[2] == writer]
        assert own == sorted(own) and len(own) in (4, 8)


def test_names_keep_order_when_the_clock_steps_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ticks = iter([5_000_000_000_000_000, 4_000_000_000_000_000, 4_000_000_000_000_000])
    monkeypatch.setattr(time, "time_ns", lambda: next(ticks))
    sink = _sink(tmp_path)
    names = []
    for i in range(3):
        sink.write_turns([make_turn("r", i)])
        sink.flush()
        names.append(_published(tmp_path)[-1].name)
    assert names == sorted(names) and len(set(names)) == 3


def test_files_carry_version_and_identity(tmp_path: Path) -> None:
    identity = {"turnstile.model": "", "turnstile.tokenizer": "tok"}
    sink = ParquetShardSink(tmp_path, writer_id="replica-3", identity=identity, fsync=False)
    identity["turnstile.model"] = "qwen"  # filled in after start-up
    sink.write_samples([make_sample()])
    sink.close()
    (path,) = _published(tmp_path, "samples")
    meta = pq.read_schema(path).metadata
    assert meta[b"turnstile.schema_version"] == str(SCHEMA_VERSION).encode()
    assert meta[b"turnstile.table"] == b"samples"
    assert meta[b"turnstile.model"] == b"qwen"
    assert meta[b"turnstile.tokenizer"] == b"tok"
    assert meta[b"turnstile.writer"] == b"replica-3"


def test_token_columns_are_zstd_without_dictionary(tmp_path: Path) -> None:
    sink = _sink(tmp_path)
    sink.write_turns([make_turn("r", i, seed=i) for i in range(5)])
    sink.close()
    (path,) = _published(tmp_path)
    group = pq.ParquetFile(path).metadata.row_group(0)
    chunks = {group.column(i).path_in_schema: group.column(i) for i in range(group.num_columns)}
    assert {c.compression for c in chunks.values()} == {"ZSTD"}
    tokens = chunks["prompt_token_ids.list.element"]
    assert not any("DICTIONARY" in e for e in tokens.encodings)
    assert not tokens.is_stats_set
    assert any("DICTIONARY" in e for e in chunks["status"].encodings)
    assert chunks["policy_version"].is_stats_set


def _enospc(*args: Any, **kwargs: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_while_writing_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = _sink(tmp_path)
    sink.write_turns([make_turn("r", i) for i in range(3)])

    def half_write(table: pa.Table, where: str, **kwargs: Any) -> None:
        Path(where).write_bytes(b"PAR1 partial")
        _enospc()

    monkeypatch.setattr(pq, "write_table", half_write)
    with pytest.raises(SinkError, match="No space left on device") as caught:
        sink.flush()
    assert isinstance(caught.value.__cause__, OSError)
    assert caught.value.__cause__.errno == errno.ENOSPC
    assert _published(tmp_path) == [] and _strays(tmp_path) == []
    assert sink.buffered("turns") == 3  # kept for the next attempt

    monkeypatch.undo()
    sink.close()
    assert open_output(tmp_path).turns().num_rows == 3


def test_disk_full_while_syncing_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = _sink(tmp_path, fsync=True)
    sink.write_samples([make_sample()])
    monkeypatch.setattr(os, "fsync", _enospc)
    with pytest.raises(SinkError, match="cannot publish 1 samples rows"):
        sink.flush()
    assert _published(tmp_path, "samples") == [] and _strays(tmp_path) == []
    monkeypatch.undo()
    sink.flush()
    assert len(_published(tmp_path, "samples")) == 1


def test_unconvertible_records_are_quarantined_not_dropped(tmp_path: Path) -> None:
    sink = _sink(tmp_path)
    bad = make_turn(completion_len=3, behavior_logprobs=make_turn().behavior_logprobs[:1])
    sink.write_turns([bad])
    sink.write_rollouts([make_rollout()])
    sink.flush()  # nothing raised: the row went to the quarantine, the rest was published
    assert sink.buffered("turns") == 0
    assert _published(tmp_path, "turns") == []  # its chunk held only the bad row
    assert len(_published(tmp_path, "rollouts")) == 1
    assert len(_published(tmp_path, "quarantine")) == 1
    progress = sink.progress()
    assert progress.covers(progress.accepted)
    assert progress.quarantined == {"turns": 1}
    assert "1 logprobs for 3 completion tokens" in (progress.quarantine_reason or "")


def test_unwritable_output_dir_raises_sink_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(SinkError, match="cannot prepare output directory"):
        _sink(blocker / "out")


def test_bad_arguments_are_rejected(tmp_path: Path) -> None:
    for writer_id in ("", ".hidden", "a/b", "x" * 200):
        with pytest.raises(ValueError, match="writer_id"):
            _sink(tmp_path, writer_id)
    with pytest.raises(ValueError, match="max_rows"):
        _sink(tmp_path, max_rows=0)
    with pytest.raises(ValueError, match="may not set"):
        ParquetShardSink(tmp_path, writer_id="w", identity={"table": "x"})


def test_in_memory_fake_follows_the_protocol() -> None:
    fake = InMemorySink()
    sink: Sink = fake
    sink.write_turns([make_turn()])
    assert fake.pending_turns and not fake.turns
    sink.maybe_roll(None)
    assert len(fake.turns) == 1 and fake.tables()["turns"].num_rows == 1
    fake.fail_with = SinkError("disk full")
    with pytest.raises(SinkError, match="disk full"):
        sink.write_samples([make_sample()])
    sink.close()
    assert fake.closed
    with pytest.raises(SinkError):
        sink.write_rollouts([make_rollout()])


def _manifest_names(sink: ParquetShardSink) -> list[str]:
    data = json.loads(sink.manifest_path.read_text())
    assert data["writer_id"] == sink.writer_id
    return sorted(f"{e['table']}/{e['name']}" for e in data["shards"])


def _own_shards(out: Path, writer_id: str) -> list[str]:
    names = []
    for path in out.glob("*/part-*.parquet"):
        match = NAME.fullmatch(path.name)
        if match and match[2] == writer_id and path.parent.name != STAGING_DIR:
            names.append(f"{path.parent.name}/{path.name}")
    return sorted(names)


def test_each_writer_keeps_a_manifest_of_its_own_shards(tmp_path: Path) -> None:
    a, b = _sink(tmp_path, "replica-a", max_rows=2), _sink(tmp_path, "replica-b", max_rows=2)
    a.write_turns([make_turn("r", i) for i in range(4)])
    b.write_turns([make_turn("s", i) for i in range(2)])
    assert _manifest_names(a) == _own_shards(tmp_path, "replica-a")
    assert len(_manifest_names(a)) == 2
    assert _manifest_names(b) == _own_shards(tmp_path, "replica-b") and len(_manifest_names(b)) == 1


def test_a_manifest_lost_in_a_crash_is_rebuilt_at_start_up(tmp_path: Path) -> None:
    sink = _sink(tmp_path, "replica-a", max_rows=2)
    sink.write_turns([make_turn("r", i) for i in range(4)])
    published = _own_shards(tmp_path, "replica-a")
    # A crash between a publish and the manifest rewrite: the manifest lags the shards.
    sink.manifest_path.write_text(
        json.dumps({"manifest_version": 1, "writer_id": "replica-a", "shards": []})
    )
    restarted = _sink(tmp_path, "replica-a", max_rows=2)
    assert _manifest_names(restarted) == published


def test_a_failed_manifest_rewrite_is_retried_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = _sink(tmp_path, "replica-a", max_rows=2)
    real_replace = os.replace

    def full_for_manifests(src: Any, dst: Any) -> None:
        if "_manifests" in str(dst):
            _enospc()
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", full_for_manifests)
    sink.write_turns([make_turn("r", i) for i in range(2)])  # published, manifest not
    assert _own_shards(tmp_path, "replica-a") and not _manifest_names(sink)
    monkeypatch.setattr(os, "replace", real_replace)
    sink.write_turns([make_turn("r", i) for i in range(2, 4)])
    assert _manifest_names(sink) == _own_shards(tmp_path, "replica-a")
    assert len(_manifest_names(sink)) == 2
