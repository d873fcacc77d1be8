"""`--output s3://...` against a real S3-compatible server (moto's, on loopback),
including a store outage in the middle of a run: retries, then nothing lost."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer
from starlette.testclient import TestClient

from tests.fakes_backend import FakeVLLM
from turnstile.output.objstore import ObjectStorePublisher, open_store
from turnstile.reader import open_output
from turnstile.server.app import create_app
from turnstile.settings import load_settings
from turnstile.train import ShardFollower

BUCKET = "rl-runs"
# Everything here is on loopback; each wait is far above what it takes on a busy machine.
WAIT_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Store:
    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: ThreadedMotoServer | None = None

    def start(self) -> None:
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self) -> None:
        assert self.server is not None
        self.server.stop()
        self.server = None


@contextlib.contextmanager
def _s3(url: str) -> Iterator[Any]:
    """A boto3 client closed when done: its pooled socket must not outlive the test (the
    store stops mid-test, and a socket collected later is an unraisable ResourceWarning
    that fails whichever test is running then)."""
    client = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "testing")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s = Store()
    s.start()
    with _s3(s.url) as s3:
        s3.create_bucket(Bucket=BUCKET)
    yield s
    if s.server is not None:
        s.stop()


def _wait(cond: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _rollouts(client: TestClient, n: int, version: int) -> list[str]:
    ids = []
    for _ in range(n):
        rid = client.post("/rollouts", json={}).json()["rollout_id"]
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
        resp = client.post(
            f"/rollouts/{rid}/v1/chat/completions",
            json=body,
            headers={"X-Turnstile-Policy-Version": str(version)},
        )
        assert resp.status_code == 200
        assert client.post(f"/rollouts/{rid}/finish").status_code == 200
        ids.append(rid)
    return ids


def test_shards_reach_the_store_through_an_outage(store: Store, tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    settings = load_settings(
        None,
        {
            "output": f"s3://{BUCKET}/run-1",
            "staging_dir": staging,
            "object_store_endpoint": store.url,
            "shard_max_age_s": 0.2,
            "writer_id": "replica-a",
        },
        environ={},
    )
    assert settings.output == staging and settings.output_uri == f"s3://{BUCKET}/run-1"
    app = create_app(settings, backend=FakeVLLM())
    publisher = app.state.publisher
    assert isinstance(publisher, ObjectStorePublisher)
    publisher.backoff_initial_s = 0.05
    with TestClient(app) as client:
        before = _rollouts(client, 5, version=1)
        _wait(lambda: publisher.stats.uploaded >= 3 and not publisher.staged(), "first upload")
        store.stop()  # the store goes away while the proxy keeps recording
        during = _rollouts(client, 5, version=2)
        _wait(
            lambda: publisher.staged() and publisher.stats.attempts_failed >= 2,
            "failed upload attempts",
        )
        staged_during_outage = len(publisher.staged())
        store.start()
        _wait(lambda: not publisher.staged(), "the upload after the outage")
        after = _rollouts(client, 2, version=3)
    assert staged_during_outage >= 1
    assert not publisher.staged()  # the shutdown pass published the rest
    # nothing the journal needs is in the store: it stays local
    assert (staging / "journal").is_dir() or any(staging.iterdir())
    fs, root = open_store(f"s3://{BUCKET}/run-1", endpoint=store.url)
    out = open_output(root, filesystem=fs)
    rollouts = out.rollouts().column("rollout_id").to_pylist()
    assert sorted(rollouts) == sorted(before + during + after)  # each exactly once
    assert out.turns().num_rows == 12
    assert sorted(
        out.samples(policy_version_min=2, policy_version_max=2).column("rollout_id").to_pylist()
    ) == sorted(during)
    with _s3(store.url) as s3:
        manifests = s3.list_objects_v2(Bucket=BUCKET, Prefix="run-1/_manifests/")["Contents"]
    assert [m["Key"] for m in manifests] == ["run-1/_manifests/replica-a.json"]
    assert publisher.stats.attempts_failed >= 2 and publisher.stats.last_error


def test_uncommitted_objects_are_invisible(store: Store, tmp_path: Path) -> None:
    """An object uploaded without a manifest entry (a crash between the two steps) is
    not read; the next pass re-uploads and commits it."""
    fs, root = open_store(f"s3://{BUCKET}/run-2", endpoint=store.url)
    staging = tmp_path / "staging"
    settings = load_settings(None, {"output": staging, "shard_max_age_s": 0.2}, environ={})
    with TestClient(create_app(settings, backend=FakeVLLM())) as client:
        _rollouts(client, 2, version=0)
    publisher = ObjectStorePublisher(staging, fs, root, writer_id="w")
    (table, path), *_ = publisher.staged()
    publisher._upload(table, path)  # step 1 only
    assert open_output(root, filesystem=fs).rollouts().num_rows == 0
    host = store.url.removeprefix("http://")
    uri = f"s3://{BUCKET}/run-2?endpoint_override={host}&scheme=http&region=us-east-1"
    assert list(ShardFollower(uri, statuses=None)) == []  # the trainer side agrees
    staged = len(publisher.staged())
    assert publisher.sync_once() == staged and not publisher.staged()
    assert len(list(ShardFollower(uri, statuses=None))) == 2
    out = open_output(root, filesystem=fs)
    assert out.rollouts().num_rows == 2 and out.turns().num_rows == 2
    assert open_output(f"s3://{BUCKET}/run-2", filesystem=fs).turns().num_rows == 2
