"""A row that cannot be written goes to the quarantine with its reason; its neighbours are
published, nothing is dropped, and the incident stays visible until an operator acts."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pytest
from starlette.testclient import TestClient

from tests.fakes_sink import make_rollout, make_sample, make_turn
from turnstile.backends.fake import FakeVLLM
from turnstile.cli.verify import EXIT_QUARANTINED, verify
from turnstile.journal.codec import decode_turn
from turnstile.output.quarantine import isolate, quarantine, safe_text
from turnstile.output.schema import quarantine_table, turns_table
from turnstile.output.shards import ParquetShardSink, SinkError
from turnstile.reader import open_output
from turnstile.records import TurnRecord
from turnstile.server.app import create_app
from turnstile.settings import load_settings

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def _sink(out: Path, **kwargs: Any) -> ParquetShardSink:
    return ParquetShardSink(out, writer_id="w1", identity={"model": "m"}, **kwargs)


def _bad_turns() -> list[TurnRecord]:
    """Turns that pass every Python check but not Arrow: int64 and int32 overflow."""
    return [
        make_turn("bad-a", 0, policy_version=2**63),
        make_turn("bad-b", 0, choice_index=2**40),
    ]


def _shards(out: Path, table: str) -> list[Path]:
    return sorted((out / table).glob("part-*.parquet"))


# -- isolate and quarantine ---------------------------------------------------------------


def test_isolate_finds_each_bad_row_in_few_builds() -> None:
    rows = list(range(1024))
    bad = {5, 600, 601}
    builds = []

    def build(part: Any) -> int:
        builds.append(len(part))
        if bad & set(part):
            raise ValueError(f"bad rows {sorted(bad & set(part))}")
        return len(part)

    parts, refused = isolate(rows, build)
    assert [row for row, _ in refused] == [5, 600, 601]
    assert all("bad rows" in why for _, why in refused)
    assert [row for part, _ in parts for row in part] == [r for r in rows if r not in bad]
    assert len(builds) < 3 * 2 * 11  # O(bad * log n), not O(n)


def test_a_quarantine_row_is_always_writable() -> None:
    hostile = make_turn("r\udc80", 0, turn_id="t\ud800", choice_index=2**70, policy_version=2**63)
    held = [
        quarantine("turns", hostile, "because \udcff"),
        quarantine("samples", make_sample(), "x" * 10_000),
        quarantine("samples", {"rollout_id": "r1", "turns": [[1, 2]]}, "cannot stitch"),
    ]
    table = quarantine_table(held)
    rows = table.to_pylist()
    assert rows[0]["turn_id"] == "t\\ud800" and rows[0]["rollout_id"] == "r\\udc80"
    assert rows[0]["choice_index"] is None  # past int64: the key is in the record
    assert rows[0]["reason"] == "because \\udcff"
    assert len(rows[1]["reason"]) < 5000 and rows[1]["sample_index"] == 0
    assert rows[2]["rollout_id"] == "r1" and rows[2]["record_format"] == "json"
    assert safe_text("\ud800x").encode()  # encodes as UTF-8


def test_a_quarantined_turn_reads_back_from_its_journal_payload() -> None:
    bad = _bad_turns()[0]
    held = quarantine("turns", bad, "overflow")
    assert held.record_format == "journal"
    back = decode_turn(held.record)
    assert back.turn_id == bad.turn_id and back.policy_version == 2**63
    assert np.array_equal(back.prompt_token_ids, bad.prompt_token_ids)


# -- the sink -----------------------------------------------------------------------------


def test_bad_rows_are_quarantined_and_their_neighbours_published_in_one_shard(
    tmp_path: Path,
) -> None:
    sink = _sink(tmp_path)
    good = [make_turn(f"g{i}", 0, seed=i) for i in range(8)]
    bad = _bad_turns()
    rows = good[:3] + bad[:1] + good[3:6] + bad[1:] + good[6:]
    sink.write_turns(rows[:4])
    mark = sink.progress().accepted  # covers the first bad row
    sink.write_turns(rows[4:])
    sink.write_samples([make_sample()])
    assert not sink.progress().covers(mark)
    sink.flush()
    progress = sink.progress()
    assert progress.covers(mark) and progress.covers(progress.accepted)
    assert progress.quarantined == {"turns": 2}
    assert len(_shards(tmp_path, "turns")) == 1  # the good rows together, as always
    published = open_output(tmp_path).turns(columns=["rollout_id"]).column(0).to_pylist()
    assert published == [t.rollout_id for t in good]
    held = open_output(tmp_path).quarantine().to_pylist()
    assert [(h["table"], h["turn_id"], h["choice_index"]) for h in held] == [
        ("turns", "bad-a-t0", 0),
        ("turns", "bad-b-t0", 2**40),
    ]
    assert "int64" in held[0]["reason"] or "overflow" in held[0]["reason"].lower()
    assert len(_shards(tmp_path, "samples")) == 1


def test_a_failing_quarantine_changes_nothing_until_it_can_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = _sink(tmp_path)
    sink.write_turns([make_turn("g", 0), *_bad_turns()])
    real_rename = os.rename
    calls = {"n": 0}

    def rename(src: Any, dst: Any) -> None:
        calls["n"] += 1
        if "quarantine" in str(dst):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(SinkError, match="No space left"):
        sink.flush()
    assert sink.buffered("turns") == 3 and _shards(tmp_path, "turns") == []
    monkeypatch.undo()
    sink.flush()
    assert len(open_output(tmp_path).quarantine()) == 2  # once each, not again
    assert len(open_output(tmp_path).turns()) == 1


def test_good_rows_that_fail_to_publish_after_the_quarantine_are_not_quarantined_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = _sink(tmp_path)
    sink.write_turns([make_turn("g", 0), *_bad_turns()])
    real_rename = os.rename

    def rename(src: Any, dst: Any) -> None:
        if f"{os.sep}turns{os.sep}" in str(dst):
            raise OSError(errno.EIO, "I/O error")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(SinkError, match="I/O error"):
        sink.flush()
    assert not sink.progress().covers(sink.progress().accepted)
    monkeypatch.undo()
    sink.flush()
    assert sink.progress().covers(sink.progress().accepted)
    assert len(open_output(tmp_path).quarantine()) == 2
    assert open_output(tmp_path).turns(columns=["rollout_id"]).column(0).to_pylist() == ["g"]


def test_a_failure_names_every_table_that_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = _sink(tmp_path)
    sink.write_samples([make_sample()])
    sink.write_rollouts([make_rollout()])

    def rename(src: Any, dst: Any) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(SinkError) as failed:
        sink.flush()
    assert "samples rows" in str(failed.value) and "rollouts rows" in str(failed.value)


# -- the whole app: F1 through a value no check foresaw -------------------------------------


def _wait(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_one_unwritable_turn_costs_nobody_else_data_and_stays_visible(tmp_path: Path) -> None:
    out = tmp_path / "out"
    settings = load_settings(None, {"output": out, "shard_max_rows": 8}, environ={})
    app = create_app(settings, backend=FakeVLLM())
    with TestClient(app) as client:
        for i in range(20):
            assert client.post(f"/rollouts/a{i}/v1/chat/completions", json=BODY).status_code == 200
            assert client.post(f"/rollouts/a{i}/finish").status_code == 200
        # A turn with a value no edge check foresaw, journaled and handed to the writer
        # as the proxy would (fault injection below the edge).
        proxy = app.state.proxy
        bad = make_turn("a-bad", 0, policy_version=2**63)
        proxy.recorder.submit_turns([bad], pin=proxy.journal.append(bad))
        for i in range(20, 30):
            assert client.post(f"/rollouts/a{i}/v1/chat/completions", json=BODY).status_code == 200
            assert client.post(f"/rollouts/a{i}/finish").status_code == 200
        _wait(lambda: client.get("/health").json()["recorder"]["incident"] is not None)
        health = client.get("/health")
        assert health.status_code == 200  # serving goes on
        body = health.json()
        assert body["status"] == "degraded"
        assert "quarantined" in body["recorder"]["incident"]["message"]
        assert body["recorder"]["quarantined"] == {"turns": 1}
        stats = client.get("/stats").json()
        assert stats["quarantined"] == {"turns": 1} and stats["dropped"] == 0
        metrics = client.get("/metrics").text
        assert 'turnstile_quarantined_rows_total{table="turns"} 1.0' in metrics
        assert "turnstile_recorder_incident 1.0" in metrics
        # Still there a while later, after good writes: only an operator clears it.
        assert client.post("/rollouts/late/v1/chat/completions", json=BODY).status_code == 200
        assert client.get("/health").json()["recorder"]["incident"] is not None
        acked = client.post("/admin/recorder/ack").json()
        assert "quarantined" in acked["acknowledged"]["message"]
        assert client.get("/health").json()["status"] == "ok"
        assert "turnstile_recorder_incident 0.0" in client.get("/metrics").text
        assert client.get("/stats").json()["quarantined"] == {"turns": 1}
    reader = open_output(out)
    turns = reader.turns(columns=["rollout_id"]).column(0).to_pylist()
    assert sorted(turns) == sorted([f"a{i}" for i in range(30)] + ["late"])
    assert len(reader.rollouts()) == 31 and len(reader.samples()) == 31  # "late": interrupted
    held = reader.quarantine().to_pylist()
    assert [h["turn_id"] for h in held] == ["a-bad-t0"]
    assert decode_turn(held[0]["record"]).policy_version == 2**63
    # Every row is settled (published or quarantined): the journal is not kept.
    assert not list((out / "journal").glob("*.wal"))
    report = verify(out)
    assert report.ok and report.quarantined == {"turns": 1}
    assert report.exit_code == EXIT_QUARANTINED
    # A restart writes nothing twice.
    with TestClient(create_app(settings, backend=FakeVLLM())) as client:
        assert client.get("/health").json()["status"] == "ok"
    assert len(open_output(out).turns()) == 31 and len(open_output(out).quarantine()) == 1


def test_verify_counts_journaled_turns_against_shards_plus_quarantine(tmp_path: Path) -> None:
    out = tmp_path / "out"
    settings = load_settings(None, {"output": out}, environ={})
    app = create_app(settings, backend=FakeVLLM())
    with TestClient(app) as client:
        assert client.post("/rollouts/r/v1/chat/completions", json=BODY).status_code == 200
        proxy = app.state.proxy
        bad = make_turn("r-bad", 0, choice_index=2**40)
        proxy.recorder.submit_turns([bad], pin=proxy.journal.append(bad))
        client.post("/rollouts/r/finish")
        # Leave the journal behind as a crash would: copy it before the clean shutdown.
        _wait(lambda: proxy.recorder.backlog == 0)
        journal = {p: p.read_bytes() for p in (out / "journal").glob("*.wal")}
    for path, data in journal.items():
        path.write_bytes(data)
    report = verify(out)
    assert report.journal_turns == 2
    assert report.published_turns == 1 and report.quarantined_turns == 1
    assert report.unpublished_turns == 0 and report.ok
    # A journaled turn in neither place fails verify.
    for table in ("turns", "quarantine"):
        for shard in _shards(out, table):
            shard.unlink()
    report = verify(out)
    assert report.unpublished_turns == 2 and not report.ok


def test_the_quarantine_table_round_trips() -> None:
    held = quarantine("turns", make_turn(), "why")
    table = quarantine_table([held])
    assert table.schema.field("record").type == pa.large_binary()
    row = table.to_pylist()[0]
    assert orjson.loads(orjson.dumps(row["reason"])) == "why"
    assert turns_table([decode_turn(row["record"])]).num_rows == 1
