"""Start-up recovery from a journal a crashed run left behind."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.testclient import TestClient

from tests.fakes_sink import make_turn
from tests.images import png
from tests.unit.conftest import MakeApp
from turnstile.images import sha256_hex
from turnstile.journal.codec import Event, RewardsPosted, RolloutCreated, encode_event
from turnstile.journal.wal import FileJournal, list_segments
from turnstile.records import ImageRef, MediaBlob, RolloutStatus

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _crashed_run(output: Path) -> None:
    """What a run killed mid-rollout leaves: a journal, no shards."""
    journal = FileJournal(output / "journal", fsync="always")
    events: list[Event] = [
        RolloutCreated("r", "g", "t", {"k": 1}, False, 1.0),
        make_turn("r", 0, seed=1, turn_id="call-0"),
        make_turn("r", 1, seed=2, turn_id="call-1"),
        RewardsPosted("r", {"correct": 1.0}, {}),
    ]
    for event in events:
        seq = journal.append(*encode_event(event))
    journal.commit(seq)
    journal.close()


@pytest.mark.parametrize("mode", ["restore", "interrupt"])
def test_open_rollouts_are_restored_or_interrupted(
    make_app: MakeApp, tmp_path: Path, mode: str
) -> None:
    _crashed_run(tmp_path / "out")
    h = make_app(recover_open_rollouts=mode)
    with TestClient(h.app) as client:
        state = client.get("/rollouts/r").json()
        if mode == "restore":
            assert state["status"] == "open" and state["num_turns"] == 2
            resp = client.post("/rollouts/r/v1/chat/completions", json=BODY)
            assert resp.headers["X-Turnstile-Turn"] == "2"
            client.post("/rollouts/r/finish")
        else:
            assert state["status"] == "interrupted"
            assert client.post("/rollouts/r/v1/chat/completions", json=BODY).status_code == 409
    assert {"call-0", "call-1"} <= {t.turn_id for t in h.sink.turns}
    (rollout,) = h.sink.rollouts
    assert rollout.group_id == "g" and rollout.rewards[0].value == 1.0
    expected = RolloutStatus.FINISHED if mode == "restore" else RolloutStatus.INTERRUPTED
    assert rollout.status is expected
    assert list_segments(tmp_path / "out" / "journal") == []  # clean stop: all published


def test_a_crashed_runs_images_are_stored_from_the_journal(
    make_app: MakeApp, tmp_path: Path
) -> None:
    """The image bytes travel in the turn's journal frame: a run killed before its
    shards were published still gets its images into the media table."""
    image = png(56, 28, seed=5)
    sha = sha256_hex(image)
    turn = make_turn("r", 0, seed=1, turn_id="call-0")
    turn.images = [ImageRef(sha, None, 1, 2)]
    turn.media = [MediaBlob(sha, "image/png", image)]
    journal = FileJournal(tmp_path / "out" / "journal", fsync="always")
    journal.append(*encode_event(RolloutCreated("r", None, None, None, False, 1.0)))
    seq = journal.append(*encode_event(turn))
    journal.commit(seq)
    journal.close()
    h = make_app(recover_open_rollouts="interrupt")
    with TestClient(h.app):
        pass
    assert [(m.sha256, m.data) for m in h.sink.media] == [(sha, image)]
    (recorded,) = [t for t in h.sink.turns if t.turn_id == "call-0"]
    assert recorded.images == [ImageRef(sha, None, 1, 2)]
