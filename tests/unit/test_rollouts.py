"""Rollout life cycle: turns, rewards, sealing, the idle sweep and the hand-over."""

from __future__ import annotations

import time

import pytest
from starlette.testclient import TestClient

from tests.unit.conftest import MakeApp
from turnstile.errors import BadRequest, Conflict, NotFound
from turnstile.proxy.rollouts import Rollout, RolloutRegistry
from turnstile.records import RolloutStatus


def make() -> tuple[RolloutRegistry, list[Rollout]]:
    handed: list[Rollout] = []
    return RolloutRegistry(lambda r: handed.append(r), idle_timeout_s=60.0), handed


def test_unknown_id_is_created_on_first_use_and_counts_turns() -> None:
    reg, _ = make()
    rollout, first = reg.begin_turn("abc")
    _, second = reg.begin_turn("abc")
    assert (first, second) == (0, 1) and rollout.in_flight == 2
    assert reg.get("abc") is rollout


def test_finish_waits_for_in_flight_turns_before_hand_over() -> None:
    reg, handed = make()
    rollout, _ = reg.begin_turn("r")
    reg.finish("r")
    assert rollout.status is RolloutStatus.FINISHED and handed == []
    with pytest.raises(Conflict):
        reg.begin_turn("r")
    reg.end_turn(rollout, [])
    assert handed == [rollout]
    with pytest.raises(Conflict):
        reg.finish("r")
    assert reg.get("r").summary()["status"] == "finished"


def test_rewards_merge_and_are_refused_after_sealing() -> None:
    reg, _ = make()
    reg.create("r")
    reg.add_rewards("r", {"a": 1.0}, {})
    reg.add_rewards("r", {"b": 0.5}, {"a": "verifier said yes"})
    rewards = reg.get("r").rewards
    assert (rewards["a"].value, rewards["a"].info, rewards["b"].value) == (
        1.0,
        "verifier said yes",
        0.5,
    )
    reg.finish("r")
    with pytest.raises(Conflict, match="before /finish"):
        reg.add_rewards("r", {"c": 1.0}, {})


def test_idle_rollouts_are_abandoned_but_busy_ones_are_not() -> None:
    reg, handed = make()
    idle = reg.create("idle")
    busy, _ = reg.begin_turn("busy")
    later = time.monotonic() + 61
    assert reg.sweep(later) == [idle]
    assert idle.status is RolloutStatus.ABANDONED and handed == [idle]
    assert busy.status is RolloutStatus.OPEN


def test_seal_all_interrupts_open_rollouts() -> None:
    reg, handed = make()
    reg.create("a")
    reg.begin_turn("b")
    assert reg.seal_all() == 2
    assert {r.status for r in handed} == {RolloutStatus.INTERRUPTED}
    assert reg.open_count == 0


def test_ids_are_checked_and_duplicates_refused() -> None:
    reg, _ = make()
    with pytest.raises(BadRequest):
        reg.create("has space")
    with pytest.raises(BadRequest):
        reg.begin_turn("x" * 200)
    reg.create("dup")
    with pytest.raises(Conflict):
        reg.create("dup")
    with pytest.raises(NotFound):
        reg.get("missing")


def test_memory_held_by_open_rollouts_is_bounded(make_app: MakeApp) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 2000}]}
    h = make_app(max_rollout_bytes=15_000, max_open_rollout_bytes=35_000)
    with TestClient(h.app) as client:
        assert client.post("/rollouts/a/v1/chat/completions", json=body).status_code == 200
        held = client.get("/stats").json()["open_rollout_bytes"]
        assert 2000 < held < 15_000  # ~10 KB: the messages and the token arrays
        assert client.post("/rollouts/a/v1/chat/completions", json=body).status_code == 200
        over = client.post("/rollouts/a/v1/chat/completions", json=body)
        assert over.status_code == 409 and "finish it" in over.json()["error"]["message"]
        assert client.post("/rollouts/b/v1/chat/completions", json=body).status_code == 200
        assert client.post("/rollouts/b/v1/chat/completions", json=body).status_code == 200
        full = client.post("/rollouts/c/v1/chat/completions", json=body)
        assert full.status_code == 503 and full.headers["Retry-After"] == "5"
        client.post("/rollouts/a/finish")
        assert client.get("/stats").json()["open_rollout_bytes"] < 35_000
        assert client.post("/rollouts/c/v1/chat/completions", json=body).status_code == 200
    assert {t.rollout_id for t in h.sink.turns} == {"a", "b", "c"}
