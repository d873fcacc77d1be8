"""A finished rollout, and a complete group, reach readers within a second; groups are
declared with their size, shown by GET /groups/{id}, and published whole."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from tests.unit.conftest import MakeApp
from turnstile.backends.fake import FakeVLLM
from turnstile.journal.codec import RolloutCreated, decode_event, encode_event
from turnstile.journal.rebuild import RebuiltRollout
from turnstile.reader import open_output
from turnstile.server.app import create_app
from turnstile.settings import load_settings

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
# Far longer than any test: only prompt publication (or a flush) can publish.
SHARD_AGE_S = 600.0


def _app(out: Path, **overrides: Any) -> Any:
    settings = load_settings(
        None, {"output": out, "shard_max_age_s": SHARD_AGE_S, **overrides}, environ={}
    )
    return create_app(settings, backend=FakeVLLM())


def _published(out: Path) -> set[str]:
    if not (out / "rollouts").is_dir():
        return set()
    return set(open_output(out).rollouts(columns=["rollout_id"]).column(0).to_pylist())


def _run(client: TestClient, rid: str, group: str | None = None, size: int | None = None) -> None:
    body: dict[str, Any] = {"rollout_id": rid}
    if group is not None:
        body["group_id"] = group
    if size is not None:
        body["group_size"] = size
    assert client.post("/rollouts", json=body).status_code == 201
    assert client.post(f"/rollouts/{rid}/v1/chat/completions", json=BODY).status_code == 200


def _visible_within(out: Path, rollout_ids: set[str], timeout_s: float) -> float:
    start = time.monotonic()
    while not rollout_ids <= _published(out):
        assert time.monotonic() - start < timeout_s, f"not published: {rollout_ids}"
        time.sleep(0.01)
    return time.monotonic() - start


def test_a_finished_rollout_is_visible_within_a_second(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with TestClient(_app(out)) as client:
        _run(client, "solo")
        assert client.post("/rollouts/solo/finish").status_code == 200
        _visible_within(out, {"solo"}, timeout_s=1.0)
        samples = open_output(out).wait_for(["solo"], timeout_s=1.0)
        assert samples.column("rollout_id").to_pylist() == ["solo"]
        assert len(open_output(out).turns()) == 1  # its turns came with it


def test_a_group_is_published_when_its_last_rollout_finishes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with TestClient(_app(out, publish_delay_s=0.2)) as client:
        for i in range(3):
            _run(client, f"g-{i}", group="g", size=3 if i == 0 else None)
        group = client.get("/groups/g").json()
        assert (group["group_size"], group["num_rollouts"], group["complete"]) == (3, 3, False)
        for i in range(2):
            client.post(f"/rollouts/g-{i}/finish")
        time.sleep(0.6)  # three publish delays: an incomplete group stays unpublished
        assert _published(out) == set()
        assert client.get("/groups/g").json()["sealed"] == 2
        client.post("/rollouts/g-2/finish")
        _visible_within(out, {"g-0", "g-1", "g-2"}, timeout_s=1.0)
        assert client.get("/groups/g").json()["complete"] is True
        samples = open_output(out).wait_for(group_ids=["g"], timeout_s=1.0)
        assert sorted(samples.column("rollout_id").to_pylist()) == ["g-0", "g-1", "g-2"]
    rows = open_output(out).rollouts(columns=["rollout_id", "group_size"]).to_pylist()
    assert {r["group_size"] for r in rows} == {3}


def test_seals_within_the_delay_share_one_shard(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with TestClient(_app(out, publish_delay_s=0.3)) as client:
        for i in range(10):
            _run(client, f"r{i}")
            client.post(f"/rollouts/r{i}/finish")
        _visible_within(out, {f"r{i}" for i in range(10)}, timeout_s=2.0)
        assert len(list((out / "rollouts").glob("part-*.parquet"))) <= 2


def test_admin_flush_publishes_what_the_writer_holds(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with TestClient(_app(out)) as client:
        _run(client, "h-0", group="h", size=2)
        client.post("/rollouts/h-0/finish")  # the group is not complete
        time.sleep(0.2)
        assert _published(out) == set()
        answer = client.post("/admin/flush")
        assert answer.status_code == 200 and answer.json()["published"] is True
        assert _published(out) == {"h-0"}  # published when the answer came


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"group_size": 2}, 422, "group_size needs a group_id"),
        ({"group_id": "g", "group_size": 0}, 422, "group_size"),
        ({"group_id": "g", "group_size": 70_000}, 422, "group_size"),
        ({"group_id": "g", "group_size": "2"}, 422, "group_size"),
        ({"group_id": "g", "group_size": 2.0}, 422, "group_size"),
    ],
)
def test_bad_group_sizes_are_refused(
    make_app: MakeApp, body: dict[str, Any], status: int, needle: str
) -> None:
    with TestClient(make_app().app) as client:
        resp = client.post("/rollouts", json=body)
        assert resp.status_code == status, resp.text
        assert needle in resp.text
        assert client.get("/groups/g").status_code == 404


def test_a_group_keeps_its_size_and_refuses_extra_rollouts(make_app: MakeApp) -> None:
    with TestClient(make_app().app) as client:
        assert client.post("/rollouts", json={"group_id": "g", "group_size": 2}).status_code == 201
        conflict = client.post("/rollouts", json={"group_id": "g", "group_size": 3})
        assert conflict.status_code == 409 and "declared with 2" in conflict.text
        assert client.post("/rollouts", json={"group_id": "g"}).status_code == 201
        extra = client.post("/rollouts", json={"group_id": "g"})
        assert extra.status_code == 409 and "already has" in extra.text
        assert client.get("/groups/g").json()["num_rollouts"] == 2
        assert client.get("/groups/nope").status_code == 404


def test_wait_for_names_what_is_missing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with TestClient(_app(out)) as client:
        _run(client, "a", group="g", size=2)
        client.post("/rollouts/a/finish")
        client.post("/admin/flush")
    with pytest.raises(TimeoutError, match=r"group g \(1 of 2\).*rollout zz"):
        open_output(out).wait_for(["zz"], ["g"], timeout_s=0.2)
    with pytest.raises(ValueError, match="at least one"):
        open_output(out).wait_for(timeout_s=0.1)


def test_the_group_size_is_journaled() -> None:
    event = RolloutCreated("r", "g", None, None, False, 1.5, group_size=4)
    assert decode_event(*encode_event(event)) == event
    old = RolloutCreated("r", "g", None, None, False, 1.5)
    decoded = decode_event(*encode_event(old))
    assert isinstance(decoded, RolloutCreated) and decoded.group_size is None
    assert RebuiltRollout("r", 1, created=event).rollout().group_size == 4
