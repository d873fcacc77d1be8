"""A full disk makes Turnstile refuse work (503, unhealthy) and lose nothing."""

from __future__ import annotations

import errno
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from starlette.testclient import TestClient

from tests.fakes_backend import FakeVLLM
from turnstile.cli.verify import verify
from turnstile.reader import open_output
from turnstile.server.app import create_app
from turnstile.settings import load_settings

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _wait(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_enospc_gives_503_and_recovers_without_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    settings = load_settings(None, {"output": out, "shard_max_rows": 1}, environ={})
    app = create_app(settings, backend=FakeVLLM())
    disk_full = {"on": True}
    real_write = pq.write_table

    def write_table(*args: Any, **kwargs: Any) -> None:
        if disk_full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(*args, **kwargs)

    monkeypatch.setattr(pq, "write_table", write_table)
    with TestClient(app) as client:
        assert client.post("/rollouts/r/v1/chat/completions", json=BODY).status_code == 200
        _wait(lambda: client.get("/health").status_code == 503)
        health = client.get("/health").json()
        assert "No space left" in health["recorder"]["error"]
        refused = client.post("/rollouts/r/v1/chat/completions", json=BODY)
        assert refused.status_code == 503 and int(refused.headers["Retry-After"]) > 0
        assert "No space left" in refused.json()["error"]["message"]
        disk_full["on"] = False
        _wait(lambda: client.get("/health").status_code == 200)
        assert client.post("/rollouts/r/v1/chat/completions", json=BODY).status_code == 200
        assert client.get("/stats").json()["dropped"] == 0
    turns = open_output(out).turns().to_pylist()
    assert [t["turn_index"] for t in sorted(turns, key=lambda t: t["turn_index"])] == [0, 1]
    assert not list((out / ".tmp").iterdir())


def test_journal_disk_full_means_no_acknowledgement(
    make_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import turnstile.journal.wal as journal

    real_write = journal._write_all
    disk_full = {"on": False}

    def write_all(fd: int, data: bytes) -> None:
        if disk_full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(fd, data)

    monkeypatch.setattr(journal, "_write_all", write_all)
    h = make_app()
    with TestClient(h.app) as client:
        assert client.post("/rollouts/j/v1/chat/completions", json=BODY).status_code == 200
        disk_full["on"] = True
        refused = client.post("/rollouts/j/v1/chat/completions", json=BODY)
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        assert "disk is full" in refused.json()["error"]["message"]
        stream = client.post("/rollouts/j/v1/chat/completions", json={**BODY, "stream": True})
        assert "data: [DONE]" not in stream.text and "disk is full" in stream.text
        disk_full["on"] = False
        assert client.post("/rollouts/j/v1/chat/completions", json=BODY).status_code == 200
    # the refused calls are still recorded, just never acknowledged
    assert len(h.sink.turns) == 4


def test_the_journal_outlives_a_shutdown_that_could_not_publish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    settings = load_settings(None, {"output": out}, environ={})
    real_write = pq.write_table

    def write_table(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pq, "write_table", write_table)
    with TestClient(create_app(settings, backend=FakeVLLM())) as client:
        for i in range(3):
            assert client.post(f"/rollouts/r{i}/v1/chat/completions", json=BODY).status_code == 200
            assert client.post(f"/rollouts/r{i}/finish").status_code == 200
    # Nothing could be published at shutdown: the journal stays, and verify says so.
    assert list((out / "journal").glob("*.wal"))
    assert not verify(out).ok
    monkeypatch.setattr(pq, "write_table", real_write)
    with TestClient(create_app(settings, backend=FakeVLLM())) as client:
        assert client.get("/health").json()["status"] == "ok"
    report = verify(out)
    assert report.ok and report.published_turns == 0 and report.rows["turns"] == 3
    assert len(open_output(out).rollouts()) == 3
