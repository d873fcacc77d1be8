"""Write-ahead order: nothing reaches a shard before its journal frame is written.

A turn published while its frame still waits for the journal's committer would, after a
crash at that moment, be in the shards but unknown to the journal: the restart restores
its rollout without it, the client's retry gets the same turn index, and the rollout ends
up with two turns of one index (the crash test's "1 duplicated, 0 missing").
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from tests.fakes_backend import FakeVLLM
from turnstile.journal.wal import FileJournal
from turnstile.reader import open_output
from turnstile.server.app import create_app
from turnstile.settings import load_settings

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
# Long enough for the writer to publish a shard the test is waiting for.
PUBLISH_WAIT_S = 2.0


def _app(out: Path) -> Any:
    settings = load_settings(None, {"output": out, "shard_max_rows": 1}, environ={})
    return create_app(settings, backend=FakeVLLM())


def _turn_indices(out: Path, rollout: str) -> list[int]:
    reader = open_output(out)
    if not reader.files("turns"):
        return []
    turns = reader.turns(columns=["rollout_id", "turn_index"]).to_pylist()
    return sorted(t["turn_index"] for t in turns if t["rollout_id"] == rollout)


def test_a_turn_reaches_a_shard_only_once_journaled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, crashed = tmp_path / "out", tmp_path / "crashed"
    held, release = threading.Event(), threading.Event()
    real_write = FileJournal._write

    def slow_write(self: FileJournal, data: bytes, batch_end: int) -> bool:
        if held.is_set():
            release.wait(10)  # the committer is stuck: the frame is not written yet
        return real_write(self, data, batch_end)

    monkeypatch.setattr(FileJournal, "_write", slow_write)
    with TestClient(_app(out)) as client:
        assert client.post("/rollouts/r/v1/chat/completions", json=BODY).status_code == 200
        held.set()
        second = threading.Thread(
            target=client.post, args=("/rollouts/r/v1/chat/completions",), kwargs={"json": BODY}
        )
        second.start()
        deadline = time.monotonic() + PUBLISH_WAIT_S
        while _turn_indices(out, "r") != [0, 1] and time.monotonic() < deadline:
            time.sleep(0.05)
        published = _turn_indices(out, "r")
        # A kill -9 now: the journal holds turn 0 only.
        shutil.copytree(out, crashed, ignore=shutil.ignore_patterns(".tmp", "journal.lock"))
        release.set()
        second.join(10)
    assert published == [0], "turn 1 was published before its journal frame was written"
    monkeypatch.setattr(FileJournal, "_write", real_write)
    with TestClient(_app(crashed)) as client:
        # The client never got turn 1's answer: it sends the call again.
        again = client.post("/rollouts/r/v1/chat/completions", json=BODY)
        assert again.headers["X-Turnstile-Turn"] == "1"
        assert client.post("/rollouts/r/finish").status_code == 200
    assert _turn_indices(crashed, "r") == [0, 1]
