"""Journal retention: published segments go while the proxy runs; nothing needed goes."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from starlette.testclient import TestClient

from tests.fakes_backend import FakeVLLM
from tests.fakes_sink import InMemorySink, make_turn
from turnstile.journal.codec import PolicyVersionSet, RolloutCreated, decode_event
from turnstile.journal.retention import removable_through
from turnstile.journal.wal import SegmentInfo, read_journal
from turnstile.output.recorder import Recorder, SealJob
from turnstile.output.shards import SinkError
from turnstile.output.stitch import RolloutInfo
from turnstile.reader import open_output
from turnstile.records import RolloutStatus
from turnstile.server.app import create_app
from turnstile.settings import load_settings

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _wait(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _segment(first: int, end: int | None, *, active: bool = False) -> SegmentInfo:
    return SegmentInfo(first, Path(f"journal-{first}.wal"), 100, end, active)


def test_removable_through_stops_at_the_floor_and_the_active_segment() -> None:
    segments = [_segment(1, 10), _segment(10, 20), _segment(20, None, active=True)]
    assert removable_through(segments, 5) is None  # segment 1 holds frames 5..9
    assert removable_through(segments, 10) == segments[0]
    assert removable_through(segments, 19) == segments[0]
    assert removable_through(segments, 20) == segments[1]
    assert removable_through(segments, 10**9) == segments[1]  # never the active one


class HoldingSink(InMemorySink):
    """Publishes only once `release` is set (on the writer thread, as a sink must be)."""

    release = False

    def maybe_roll(self, now: float | None = None) -> None:
        if self.release:
            self.flush()


def _seal_job(rollout_id: str) -> SealJob:
    turn = make_turn(rollout_id, 0)
    info = RolloutInfo(rollout_id, None, None, RolloutStatus.FINISHED, [])
    return SealJob(info, None, [turn], 1, 0.0, 1.0)


def test_recorder_holds_a_pin_until_its_rows_are_published() -> None:
    sink = HoldingSink()
    recorder = Recorder(sink, max_backlog=100, tick_s=0.01)
    recorder.start()
    recorder.submit_turns([make_turn("a", 0)], pin=7)
    recorder.submit_seal(_seal_job("b"), pin=3)
    recorder.submit_turns([make_turn("c", 0)])  # not journaled: no pin
    _wait(lambda: recorder.backlog == 0)
    time.sleep(0.05)
    assert recorder.oldest_pin == 3, "written but unpublished work must keep its frames"
    sink.release = True
    _wait(lambda: recorder.oldest_pin is None)
    assert {t.rollout_id for t in sink.turns} == {"a", "c"} and len(sink.rollouts) == 1
    assert recorder.stop(10)


def test_failed_work_keeps_its_pin() -> None:
    sink = InMemorySink()
    recorder = Recorder(sink, max_backlog=100, tick_s=0.01)
    recorder.start()
    sink.fail_with = SinkError("disk full")
    recorder.submit_turns([make_turn("a", 0)], pin=4)
    recorder.submit_turns([make_turn("b", 0)], pin=9)
    _wait(lambda: recorder.backlog == 0 and recorder.error is None)
    time.sleep(0.05)
    assert recorder.oldest_pin == 4, "a failed write's frames stay for the next start"
    assert recorder.stop(10)


def _journal_events(directory: Path) -> list[object]:
    return [decode_event(f.kind, f.payload) for f in read_journal(directory)]


def test_published_segments_are_removed_while_running_and_recovery_still_works(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    backend = FakeVLLM()
    settings = load_settings(
        None,
        {
            "output": out,
            "journal_segment_bytes": 4096,
            "journal_retention_interval_s": 0.05,
            "shard_max_age_s": 0.05,
        },
        environ={},
    )
    app = create_app(settings, backend=backend)  # the real Parquet sink
    snapshot = tmp_path / "snapshot"
    with TestClient(app) as client:
        assert client.post("/admin/policy_version", json={"policy_version": 7}).status_code == 200
        client.post("/rollouts", json={"rollout_id": "keep"})
        assert client.post("/rollouts/keep/v1/chat/completions", json=BODY).status_code == 200
        for n in range(40):
            rid = f"done-{n}"
            for _ in range(2):
                resp = client.post(f"/rollouts/{rid}/v1/chat/completions", json=BODY)
                assert resp.status_code == 200
            client.post(f"/rollouts/{rid}/finish", json={"rewards": {"r": 1.0}})
        _wait(lambda: client.get("/stats").json()["journal"]["segments_removed"] > 0)
        _wait(lambda: client.get("/stats").json()["backlog"] == 0)
        time.sleep(0.3)  # let shards age out and retention catch up
        # a long-open rollout must not hold the journal back: it shrinks to a few segments
        _wait(lambda: client.get("/health").json()["journal"]["segments"] <= 4)
        usage = client.get("/health").json()["journal"]
        assert usage["segments_removed"] > 0 and usage["segments"] >= 1
        # A crash now: the journal first, then the shards (which only grow meanwhile).
        shutil.copytree(out / "journal", snapshot / "journal")
        shutil.copytree(out, snapshot, ignore=shutil.ignore_patterns("journal"), dirs_exist_ok=True)
        (snapshot / "journal" / "journal.lock").unlink(missing_ok=True)

    events = _journal_events(snapshot / "journal")
    created = [e.rollout_id for e in events if isinstance(e, RolloutCreated)]
    assert "keep" in created, "the open rollout's frames must stay"
    assert "done-0" not in created, "the oldest published rollout's frames must be gone"
    assert [e.policy_version for e in events if isinstance(e, PolicyVersionSet)][-1] == 7

    settings2 = load_settings(None, {"output": snapshot}, environ={})
    with TestClient(create_app(settings2, backend=backend)) as client:
        assert client.get("/admin/policy_version").json() == {"policy_version": 7}
        keep = client.get("/rollouts/keep").json()
        assert keep["status"] == "open" and keep["num_turns"] == 1
        client.post("/rollouts/keep/finish")
    reader = open_output(snapshot)
    turns = reader.turns(columns=["rollout_id", "turn_index"]).to_pylist()
    keys = [(t["rollout_id"], t["turn_index"]) for t in turns]
    assert len(keys) == len(set(keys)) == 81, "every turn exactly once"
    rollouts = reader.rollouts(columns=["rollout_id", "status"]).to_pylist()
    assert len(rollouts) == len({r["rollout_id"] for r in rollouts}) == 41
    samples = reader.samples(columns=["rollout_id", "sample_index"]).to_pylist()
    assert len(samples) == len({(s["rollout_id"], s["sample_index"]) for s in samples})
    assert {s["rollout_id"] for s in samples} == {r["rollout_id"] for r in rollouts}
