"""Weight-update fences: no turn mixes two versions (pause), or a cut turn keeps its
partial tokens and the harness can retry (abort); new calls wait for the resume."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import orjson
import pytest

from tests.unit.conftest import MakeApp
from turnstile.backends.fake import Reply

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
SLOW = Reply(text="w" * 40, event_delay_s=0.03)  # 41 tokens, one event each: 1.2 s


def _slow_streams() -> Any:
    def script(body: dict[str, Any]) -> Reply:
        return SLOW if body.get("stream") else Reply()

    return script


def _stream(url: str, out: dict[str, Any]) -> None:
    lines = []
    with httpx.stream("POST", url, json={**BODY, "stream": True}, timeout=30) as resp:
        for line in resp.iter_lines():
            lines.append(line)
            out["started"] = True
    out["lines"] = [line for line in lines if line]
    out["done_at"] = time.monotonic()


def _start_stream(url: str) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}
    thread = threading.Thread(target=_stream, args=(url, out))
    thread.start()
    deadline = time.monotonic() + 10
    while not out.get("started"):
        assert time.monotonic() < deadline, "the stream did not start"
        time.sleep(0.01)
    return thread, out


def _turns(h: Any, rollout_id: str) -> list[Any]:
    return [t for t in h.sink.turns if t.rollout_id == rollout_id]


def test_pause_lets_calls_in_flight_finish_and_holds_new_ones(make_app: MakeApp, live: Any) -> None:
    h = make_app(_slow_streams())
    server = live(h.app)
    stream, out = _start_stream(f"{server.url}/rollouts/s/v1/chat/completions")
    paused = httpx.post(f"{server.url}/admin/pause", json={"mode": "pause"}, timeout=30)
    stream.join(30)
    assert paused.status_code == 200, paused.text
    assert paused.json()["in_flight_at_pause"] == 1 and paused.json()["aborted"] == 0
    assert out["lines"][-1] == "data: [DONE]"
    assert paused.json()["drain_s"] > 0.3  # it waited for the stream to finish
    # A new call waits at the fence until the resume.
    waiting: dict[str, Any] = {}

    def call() -> None:
        resp = httpx.post(f"{server.url}/rollouts/n/v1/chat/completions", json=BODY, timeout=30)
        waiting["status"], waiting["at"] = resp.status_code, time.monotonic()

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(0.4)
    assert "status" not in waiting
    assert httpx.get(f"{server.url}/stats").json()["fence"]["waiting"] == 1
    resumed_at = time.monotonic()
    resumed = httpx.post(f"{server.url}/admin/resume", json={"policy_version": 7}, timeout=10)
    caller.join(10)
    assert resumed.status_code == 200 and resumed.json()["policy_version"] == 7
    assert waiting["status"] == 200 and waiting["at"] >= resumed_at
    for rid in ("s", "n"):
        httpx.post(f"{server.url}/rollouts/{rid}/finish")
    server.stop()
    (before,) = _turns(h, "s")
    (after,) = _turns(h, "n")
    assert (before.status.value, before.policy_version) == ("ok", 0)
    assert len(before.completion_token_ids) == 41  # all of it, under the old weights
    assert (after.status.value, after.policy_version) == ("ok", 7)


def test_abort_cuts_streams_keeping_their_partial_tokens(make_app: MakeApp, live: Any) -> None:
    h = make_app(_slow_streams())
    server = live(h.app)
    stream, out = _start_stream(f"{server.url}/rollouts/s/v1/chat/completions")
    time.sleep(0.2)
    paused = httpx.post(f"{server.url}/admin/pause", json={"mode": "abort"}, timeout=30)
    stream.join(30)
    assert paused.status_code == 200 and paused.json()["aborted"] == 1
    assert out["lines"][-1] == "data: [DONE]"
    error = orjson.loads(out["lines"][-2].removeprefix("data: "))["error"]
    assert "weight update" in error["message"] and error["type"] == "overloaded_error"
    assert httpx.get(f"{server.url}/rollouts/s").json()["in_flight"] == 0
    httpx.post(f"{server.url}/admin/resume", json={"policy_version": 1})
    retried = httpx.post(f"{server.url}/rollouts/s/v1/chat/completions", json=BODY)
    assert retried.status_code == 200  # the harness retries under the new weights
    httpx.post(f"{server.url}/rollouts/s/finish")
    server.stop()
    cut, again = sorted(_turns(h, "s"), key=lambda t: t.turn_index)
    assert cut.status.value == "aborted" and "weight update" in (cut.error or "")
    assert 0 < len(cut.completion_token_ids) < 41
    assert len(cut.behavior_logprobs) == len(cut.completion_token_ids)
    assert (again.status.value, again.policy_version) == ("ok", 1)
    assert h.sink.samples and h.sink.samples[0].rollout_id == "s"


def test_fences_are_one_at_a_time(make_app: MakeApp, live: Any) -> None:
    server = live(make_app().app)
    resume = httpx.post(f"{server.url}/admin/resume", json={"policy_version": 1})
    assert resume.status_code == 409 and "no weight update" in resume.text
    assert httpx.post(f"{server.url}/admin/pause", json={"mode": "pause"}).status_code == 200
    again = httpx.post(f"{server.url}/admin/pause", json={"mode": "pause"})
    assert again.status_code == 200  # the same pause, asked again
    other = httpx.post(f"{server.url}/admin/pause", json={"mode": "abort"})
    assert other.status_code == 409 and "under way" in other.text
    bad = httpx.post(f"{server.url}/admin/pause", json={"mode": "later"})
    assert bad.status_code == 422
    assert httpx.post(f"{server.url}/admin/resume").status_code == 200


@pytest.mark.parametrize(("mode", "backend_mode"), [("pause", "wait"), ("abort", "abort")])
def test_the_backend_is_paused_and_resumed_with_the_proxy(
    make_app: MakeApp, live: Any, mode: str, backend_mode: str
) -> None:
    h = make_app(backend_pause=True)
    server = live(h.app)
    assert httpx.post(f"{server.url}/admin/pause", json={"mode": mode}).status_code == 200
    assert httpx.post(f"{server.url}/admin/resume", json={"policy_version": 2}).status_code == 200
    driven = [(m, p) for m, p, _, _ in h.backend.requests if p != "/v1/models"]
    assert driven == [("POST", f"/pause?mode={backend_mode}"), ("POST", "/resume")]
