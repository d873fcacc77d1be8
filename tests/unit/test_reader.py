"""Reading shards back: filters, merging, version checks and third-party readers."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from tests.fakes_sink import make_rollout, make_sample, make_turn
from turnstile.output.schema import SAMPLES_SCHEMA, rollouts_table, samples_table
from turnstile.output.shards import ParquetShardSink
from turnstile.reader import (
    SchemaVersionError,
    ShardFormatError,
    open_output,
    rewards_dict,
)
from turnstile.records import (
    Reward,
    RolloutRecord,
    RolloutStatus,
    SampleRecord,
    TurnRecord,
    TurnStatus,
)


def _write(
    out: Path,
    writer_id: str,
    samples: Sequence[SampleRecord] = (),
    turns: Sequence[TurnRecord] = (),
    rollouts: Sequence[RolloutRecord] = (),
) -> None:
    sink = ParquetShardSink(
        out, writer_id=writer_id, identity={"model": "m"}, max_rows=2, fsync=False
    )
    sink.write_samples(samples)
    sink.write_turns(turns)
    sink.write_rollouts(rollouts)
    sink.close()


@pytest.fixture
def out(tmp_path: Path) -> Path:
    samples = [
        make_sample("a", 0, policy_versions=[1], seed=1),
        make_sample(
            "a",
            1,
            policy_versions=[1, 2],
            seed=2,
            rewards=[Reward("correct", 0.0), Reward("format", 1.0)],
        ),
        make_sample("b", 0, policy_versions=[3], seed=3, rollout_status=RolloutStatus.ABANDONED),
    ]
    turns = [
        make_turn("a", 0, policy_version=1),
        make_turn("a", 1, policy_version=2, status=TurnStatus.ERROR),
        make_turn("b", 0, policy_version=3),
    ]
    rollouts = [
        make_rollout("a", policy_versions=[1, 2]),
        make_rollout("b", policy_versions=[3], status=RolloutStatus.ABANDONED),
    ]
    _write(tmp_path / "out", "w1", samples, turns=turns, rollouts=rollouts)
    return tmp_path / "out"


def _keys(table: pa.Table) -> list[tuple[str, int]]:
    return sorted(
        zip(
            table.column("rollout_id").to_pylist(),
            table.column("sample_index").to_pylist(),
            strict=True,
        )
    )


def test_samples_filters(out: Path) -> None:
    reader = open_output(out)
    assert _keys(reader.samples()) == [("a", 0), ("a", 1), ("b", 0)]
    assert _keys(reader.samples(policy_version_min=2)) == [("b", 0)]
    assert _keys(reader.samples(policy_version_max=2)) == [("a", 0), ("a", 1)]
    assert _keys(reader.samples(policy_version_min=1, policy_version_max=1)) == [("a", 0)]
    assert _keys(reader.samples(statuses=["abandoned"])) == [("b", 0)]
    assert _keys(reader.samples(statuses=[RolloutStatus.FINISHED], policy_version_min=1)) == [
        ("a", 0),
        ("a", 1),
    ]
    narrow = reader.samples(policy_version_min=3, columns=["rollout_id", "sample_index"])
    assert narrow.column_names == ["rollout_id", "sample_index"] and narrow.num_rows == 1


def test_turns_and_rollouts_filters(out: Path) -> None:
    reader = open_output(out)
    assert reader.turns().num_rows == 3
    assert reader.turns(policy_version_min=2).column("policy_version").to_pylist() == [2, 3]
    assert reader.turns(statuses=["error"]).column("turn_index").to_pylist() == [1]
    assert reader.rollouts(policy_version_max=2).column("rollout_id").to_pylist() == ["a"]
    assert reader.rollouts(statuses=["abandoned"]).column("rollout_id").to_pylist() == ["b"]


def test_directories_merge_in_time_order(out: Path, tmp_path: Path) -> None:
    other = tmp_path / "replica-2"
    _write(other, "w2", [make_sample("c", i) for i in range(3)])
    reader = open_output([out, str(other)])
    assert reader.samples().num_rows == 6
    names = [p.name for p in reader.files("samples")]
    assert names == sorted(names) and len(names) == 4
    assert {m["turnstile.writer"] for m in reader.metadata("samples")} == {"w1", "w2"}


def test_batches_have_the_requested_size(tmp_path: Path) -> None:
    _write(tmp_path, "w", [make_sample("r", i, seed=i) for i in range(7)])
    reader = open_output(tmp_path)
    sizes = [b.num_rows for b in reader.iter_sample_batches(3)]
    assert sizes == [3, 3, 1]
    batches = list(reader.iter_sample_batches(4, columns=["sample_index"]))
    indices = [i for b in batches for i in b.column("sample_index").to_pylist()]
    assert sorted(indices) == list(range(7)) and batches[0].num_columns == 1
    assert list(reader.iter_sample_batches(2, policy_version_min=99)) == []


def test_sample_arrays(tmp_path: Path) -> None:
    written = [
        make_sample("r", i, length=5 + i, seed=i, policy_versions=[i, i + 1]) for i in range(5)
    ]
    _write(tmp_path, "w", written)
    got = sorted(open_output(tmp_path).sample_arrays(batch_size=2), key=lambda s: s["sample_index"])
    assert len(got) == 5
    for sample, record in zip(got, written, strict=True):
        assert sample["input_ids"].dtype == np.int32
        assert sample["loss_mask"].dtype == np.int8
        assert sample["behavior_logprobs"].dtype == np.float32
        assert np.array_equal(sample["input_ids"], record.input_ids)
        assert np.array_equal(sample["loss_mask"], record.loss_mask)
        assert np.array_equal(sample["behavior_logprobs"], record.behavior_logprobs, equal_nan=True)
        assert sample["policy_versions"].tolist() == record.policy_versions
        assert sample["rewards"] == {"correct": 1.0} and sample["reward"] == 1.0
        assert sample["rollout_id"] == "r" and sample["group_id"] == "g0"
        sample["input_ids"][0] = -1  # a private, writable copy


def test_rewards_dict() -> None:
    table = samples_table([make_sample(rewards=[Reward("a", 1.0), Reward("b", -2.0, "x")])])
    cell = table.column("rewards")[0]
    assert rewards_dict(cell) == {"a": 1.0, "b": -2.0}
    assert rewards_dict(cell.as_py()) == {"a": 1.0, "b": -2.0}
    assert rewards_dict(None) == {} and rewards_dict([]) == {}


def test_missing_tables_are_empty(tmp_path: Path) -> None:
    (tmp_path / "samples").mkdir()
    table = open_output(tmp_path).samples()
    assert table.num_rows == 0 and table.schema.equals(SAMPLES_SCHEMA)
    assert open_output(tmp_path).turns().num_rows == 0
    with pytest.raises(FileNotFoundError):
        open_output(tmp_path / "absent")


def _forge(out: Path, version: str | None) -> None:
    table = samples_table([make_sample()])
    meta = dict(table.schema.metadata)
    if version is None:
        meta.pop(b"turnstile.schema_version")
    else:
        meta[b"turnstile.schema_version"] = version.encode()
    (out / "samples").mkdir(parents=True, exist_ok=True)
    pq.write_table(
        table.replace_schema_metadata(meta),
        out / "samples" / "part-9999999999999-future-000001.parquet",
    )


def test_newer_schema_version_is_refused(out: Path) -> None:
    _forge(out, "5")
    with pytest.raises(SchemaVersionError, match=r"newer schema version 5.*understands version 4"):
        open_output(out).samples()
    assert open_output(out).turns().num_rows == 3  # other tables are unaffected


def test_version_2_rollouts_read_with_a_null_group_size(tmp_path: Path) -> None:
    table = rollouts_table([make_rollout()]).drop_columns(["group_size"])
    meta = {**table.schema.metadata, b"turnstile.schema_version": b"2"}
    (tmp_path / "rollouts").mkdir()
    pq.write_table(
        table.replace_schema_metadata(meta),
        tmp_path / "rollouts" / "part-0000000000001-old-000001.parquet",
    )
    rows = open_output(tmp_path).rollouts().to_pylist()
    assert len(rows) == 1 and rows[0]["group_size"] is None


def test_version_3_shards_read_without_per_token_versions(out: Path, tmp_path: Path) -> None:
    old = tmp_path / "old"
    for table_name in ("samples", "turns"):
        (old / table_name).mkdir(parents=True)
        for path in (out / table_name).glob("part-*.parquet"):
            table = pq.read_table(path).drop_columns(
                [c for c in ("policy_version_spans", "policy_switch_unlocated")]
                if table_name == "turns"
                else ["policy_version_spans"]
            )
            meta = {**table.schema.metadata, b"turnstile.schema_version": b"3"}
            pq.write_table(table.replace_schema_metadata(meta), old / table_name / path.name)
    turns = open_output(old).turns().to_pylist()
    assert turns and all(t["policy_version_spans"] is None for t in turns)
    for arrays in open_output(old).sample_arrays():  # the oldest turn's version, per token
        mask = arrays["loss_mask"] > 0
        assert (arrays["behavior_versions"][mask] == arrays["policy_versions"].min()).all()
        assert (arrays["behavior_versions"][~mask] == -1).all()


def test_foreign_files_are_refused(tmp_path: Path) -> None:
    _forge(tmp_path, None)
    with pytest.raises(ShardFormatError, match="not a Turnstile shard"):
        open_output(tmp_path).samples()
    (tmp_path / "turns").mkdir()
    (tmp_path / "turns" / "part-0000000000000-x-000001.parquet").write_bytes(b"junk")
    with pytest.raises(ShardFormatError, match="footer"):
        open_output(tmp_path).turns()


def test_pyarrow_dataset_reads_shards_unchanged(out: Path) -> None:
    table = ds.dataset(out / "samples", format="parquet").to_table()
    assert table.num_rows == 3
    assert table.schema.equals(SAMPLES_SCHEMA)
    order = [("rollout_id", "ascending"), ("sample_index", "ascending")]
    theirs, ours = table.sort_by(order), open_output(out).samples().sort_by(order)
    exact = [c for c in table.column_names if c != "behavior_logprobs"]  # NaN != NaN
    assert theirs.select(exact).equals(ours.select(exact))
    for a, b in zip(
        theirs.column("behavior_logprobs").to_pylist(),
        ours.column("behavior_logprobs").to_pylist(),
        strict=True,
    ):
        assert np.array_equal(np.array(a, np.float32), np.array(b, np.float32), equal_nan=True)


def test_duckdb_reads_shards(out: Path) -> None:
    duckdb = pytest.importorskip("duckdb")
    rows = duckdb.sql(
        f"select rollout_id, len(input_ids), reward, rewards[1].name "
        f"from read_parquet('{out}/samples/*.parquet') order by rollout_id, sample_index"
    ).fetchall()
    assert [r[0] for r in rows] == ["a", "a", "b"]
    assert rows[0][1] == 16 and rows[0][3] == "correct" and rows[1][2] == 1.0
    ((count,),) = duckdb.sql(
        f"select count(*) from read_parquet('{out}/turns/*.parquet') where status = 'ok'"
    ).fetchall()
    assert count == 2


def test_polars_reads_shards(out: Path) -> None:
    pl = pytest.importorskip("polars")
    frame = pl.read_parquet(str(out / "samples" / "*.parquet"))
    assert frame.height == 3
    assert frame.schema["input_ids"] == pl.List(pl.Int32)
    assert frame.schema["loss_mask"] == pl.List(pl.Int8)
    lazy = pl.scan_parquet(str(out / "samples")).filter(pl.col("min_policy_version") >= 2)
    assert lazy.collect()["rollout_id"].to_list() == ["b"]
    turns = pl.read_parquet(str(out / "turns" / "*.parquet"))
    assert turns.schema["behavior_logprobs"] == pl.List(pl.Float32)


def test_hugging_face_datasets_reads_shards(
    out: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

    def no_network(self: socket.socket, address: Any) -> None:
        raise AssertionError(f"network access attempted: {address}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    loaded = datasets.load_dataset(
        "parquet",
        data_files=str(out / "samples" / "*.parquet"),
        split="train",
        cache_dir=str(tmp_path / "hf-cache"),
    )
    assert loaded.num_rows == 3
    rows = sorted(loaded, key=lambda r: (r["rollout_id"], r["sample_index"]))
    expected = sorted(
        open_output(out).samples().to_pylist(), key=lambda r: (r["rollout_id"], r["sample_index"])
    )
    assert [r["input_ids"] for r in rows] == [r["input_ids"] for r in expected]
    assert [r["rewards"] for r in rows] == [r["rewards"] for r in expected]
