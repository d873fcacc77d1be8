"""Admission control: the harness stays within max_staleness versions of the trainer."""

from __future__ import annotations

import asyncio
import threading
import time

from starlette.testclient import TestClient

from tests.unit.conftest import MakeApp
from turnstile.proxy.admission import Admission

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def test_rollouts_beyond_the_allowance_get_429_until_the_next_version(make_app: MakeApp) -> None:
    h = make_app(max_open_rollouts_per_version=2, max_staleness=1)
    with TestClient(h.app) as client:
        for i in range(4):  # 2 per version, 1 version ahead: 4 before the trainer moves
            assert client.post("/rollouts", json={"rollout_id": f"r{i}"}).status_code == 201
        refused = client.post("/rollouts", json={"rollout_id": "r4"})
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["Retry-After"]) > 0
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert "ahead of the trainer" in refused.json()["error"]["message"]
        # A call naming a new rollout is a new rollout too; known rollouts go on.
        assert client.post("/rollouts/new/v1/chat/completions", json=BODY).status_code == 429
        assert client.post("/rollouts/r0/v1/chat/completions", json=BODY).status_code == 200
        stats = client.get("/stats").json()["admission"]
        assert (stats["created"], stats["refused"], stats["allowance"]) == (4, 2, 4)
        assert stats["ahead_versions"] == 2.0
        metrics = client.get("/metrics").text
        assert "turnstile_admission_ahead_versions 2.0" in metrics
        assert "turnstile_admission_refused_total 2.0" in metrics
        # The trainer pushes version 1: two more rollouts.
        assert client.post("/admin/policy_version", json={"policy_version": 1}).status_code == 200
        assert client.post("/rollouts", json={"rollout_id": "r4"}).status_code == 201
        assert client.post("/rollouts/new/v1/chat/completions", json=BODY).status_code == 200
        assert client.post("/rollouts", json={"rollout_id": "r6"}).status_code == 429
    assert "new" in {t.rollout_id for t in h.sink.turns}


def test_without_a_limit_everything_is_admitted(make_app: MakeApp) -> None:
    with TestClient(make_app().app) as client:
        for i in range(50):
            assert client.post("/rollouts", json={"rollout_id": f"r{i}"}).status_code == 201
        stats = client.get("/stats").json()["admission"]
        assert stats["allowance"] is None and stats["ahead_versions"] is None
        assert "turnstile_admission_ahead_versions" not in client.get("/metrics").text


def test_in_wait_mode_a_creation_waits_for_the_next_version(make_app: MakeApp) -> None:
    h = make_app(max_open_rollouts_per_version=1, admission="wait")
    with TestClient(h.app) as client:
        assert client.post("/rollouts", json={"rollout_id": "a"}).status_code == 201
        answered: dict[str, float] = {}

        def create() -> None:
            resp = client.post("/rollouts", json={"rollout_id": "b"})
            answered["status"], answered["at"] = resp.status_code, time.monotonic()

        waiter = threading.Thread(target=create)
        waiter.start()
        time.sleep(0.5)
        assert "status" not in answered  # still waiting
        pushed_at = time.monotonic()
        client.post("/admin/policy_version", json={"policy_version": 1})
        waiter.join(10)
        assert answered["status"] == 201 and answered["at"] >= pushed_at


def test_the_allowance_counts_from_the_version_at_start() -> None:
    admission = Admission(per_version=3, max_staleness=0, start_version=7)
    for _ in range(3):
        admission.admit()
    assert admission.ahead == 1.0 and admission.allowance == 3
    admission.version_changed(9)  # two trainer steps
    assert admission.allowance == 9 and admission.ahead == -1.0
    admission.restart_at(9)
    assert admission.allowance == 3

    async def no_wait() -> None:  # "refuse" mode never waits
        await asyncio.wait_for(admission.wait_for_room(), 0.1)

    asyncio.run(no_wait())
