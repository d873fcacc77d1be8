"""Weight-update fences: no turn mixes two versions (pause), or a cut turn keeps its
partial tokens and the harness can retry (abort); new calls wait for the resume."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.unit.conftest import MakeApp
from turnstile.backends.fake import Reply

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
SLOW = Reply(text="w" * 40, event_delay_s=0.03)  # 41 tokens, one event each: 1.2 s
# Two parallel calls (streamed as vLLM streams them: id and name, then the arguments in
# pieces), and a stop token's id as the stop reason.
TOOL_CALLS = Reply(
    text="ok",
    finish_reason="tool_calls",
    stop_reason=151645,
    tool_calls=[
        {
            "id": f"call_{k}",
            "type": "function",
            "function": {"name": name, "arguments": f'{{"city": "{city}"}}'},
        }
        for k, (name, city) in enumerate((("weather", "Oslo"), ("time", "Lima")))
    ],
)


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
    deadline = time.monotonic() + 10  # the call reaches the fence (slowly on a busy machine)
    while httpx.get(f"{server.url}/stats").json()["fence"]["waiting"] != 1:
        assert time.monotonic() < deadline, "the new call never reached the fence"
        time.sleep(0.02)
    time.sleep(0.2)
    assert "status" not in waiting  # held there
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


# -- POST /admin/policy_version {mode}: the one-call switch, and per-token versions ---------


def _switch(url: str, version: int, mode: str | None = None) -> httpx.Response:
    body: dict[str, Any] = {"policy_version": version}
    if mode is not None:
        body["mode"] = mode
    return httpx.post(f"{url}/admin/policy_version", json=body, timeout=30)


def test_keep_switches_mid_stream_and_the_later_tokens_carry_the_new_version(
    make_app: MakeApp, live: Any
) -> None:
    h = make_app(_slow_streams())
    server = live(h.app)
    stream, out = _start_stream(f"{server.url}/rollouts/s/v1/chat/completions")
    time.sleep(0.4)
    switched = _switch(server.url, 7)  # keep is the default
    assert switched.status_code == 200, switched.text
    assert switched.json()["mode"] == "keep" and switched.json()["in_flight_at_switch"] == 1
    stream.join(30)
    assert out["lines"][-1] == "data: [DONE]"
    httpx.post(f"{server.url}/rollouts/s/finish")
    server.stop()
    (turn,) = _turns(h, "s")
    assert turn.status.value == "ok" and len(turn.completion_token_ids) == 41
    assert turn.policy_version == 0  # the version it began with
    (first, v0), (cut, v7) = turn.policy_version_spans
    assert (first, v0, v7) == (0, 0, 7)
    assert 0 < cut < 41  # the tokens before the switch under 0, the rest under 7
    assert not turn.policy_switch_unlocated
    (sample,) = [s for s in h.sink.samples if s.rollout_id == "s"]
    start = sample.turn_spans[0].completion_start
    assert sample.policy_version_spans == [(start, 0), (start + cut, 7)]


def test_keep_flags_a_whole_call_it_falls_inside(make_app: MakeApp, live: Any) -> None:
    h = make_app(lambda body: Reply(whole_delay_s=0.8))
    server = live(h.app)
    answer: dict[str, Any] = {}

    def call() -> None:
        url = f"{server.url}/rollouts/w/v1/chat/completions"
        answer["status"] = httpx.post(url, json=BODY, timeout=30).status_code

    caller = threading.Thread(target=call)
    caller.start()
    deadline = time.monotonic() + 10
    while httpx.get(f"{server.url}/stats").json()["in_flight"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert _switch(server.url, 2).json()["in_flight_at_switch"] == 1
    caller.join(30)
    assert answer["status"] == 200
    httpx.post(f"{server.url}/rollouts/w/finish")
    server.stop()
    (turn,) = _turns(h, "w")
    assert turn.policy_version == 0 and turn.policy_switch_unlocated
    assert turn.policy_version_spans == [(0, 0)]  # where the switch fell is unknown


def test_pause_mode_lets_the_stream_finish_then_switches(make_app: MakeApp, live: Any) -> None:
    h = make_app(_slow_streams())
    server = live(h.app)
    stream, out = _start_stream(f"{server.url}/rollouts/s/v1/chat/completions")
    switched = _switch(server.url, 3, "pause")
    stream.join(30)
    assert switched.status_code == 200, switched.text
    body = switched.json()
    assert (body["policy_version"], body["mode"]) == (3, "pause")
    assert (body["in_flight_at_switch"], body["aborted"]) == (1, 0)
    assert body["drain_s"] > 0.3  # it waited for the stream
    assert out["lines"][-1] == "data: [DONE]"
    assert not httpx.get(f"{server.url}/stats").json()["fence"]["closed"]
    after = httpx.post(f"{server.url}/rollouts/n/v1/chat/completions", json=BODY, timeout=30)
    assert after.status_code == 200
    for rid in ("s", "n"):
        httpx.post(f"{server.url}/rollouts/{rid}/finish")
    server.stop()
    (before,) = _turns(h, "s")
    (new,) = _turns(h, "n")
    assert before.policy_version_spans == [(0, 0)] and len(before.completion_token_ids) == 41
    assert new.policy_version_spans == [(0, 3)]


def test_abort_mode_cuts_the_stream_then_switches(make_app: MakeApp, live: Any) -> None:
    h = make_app(_slow_streams())
    server = live(h.app)
    stream, out = _start_stream(f"{server.url}/rollouts/s/v1/chat/completions")
    time.sleep(0.2)
    switched = _switch(server.url, 4, "abort")
    stream.join(30)
    assert switched.status_code == 200, switched.text
    assert (switched.json()["aborted"], switched.json()["policy_version"]) == (1, 4)
    error = orjson.loads(out["lines"][-2].removeprefix("data: "))["error"]
    assert "weight update" in error["message"] and error["type"] == "overloaded_error"
    retried = httpx.post(f"{server.url}/rollouts/s/v1/chat/completions", json=BODY, timeout=30)
    assert retried.status_code == 200
    httpx.post(f"{server.url}/rollouts/s/finish")
    server.stop()
    cut, again = sorted(_turns(h, "s"), key=lambda t: t.turn_index)
    assert cut.status.value == "aborted" and 0 < len(cut.completion_token_ids) < 41
    assert cut.policy_version_spans == [(0, 0)]
    assert (again.status.value, again.policy_version_spans) == ("ok", [(0, 4)])


def test_policy_version_modes_are_checked(make_app: MakeApp, live: Any) -> None:
    server = live(make_app().app)
    bad = _switch(server.url, 1, "later")
    assert bad.status_code == 422 and "mode" in bad.text and "keep" in bad.text
    text = httpx.post(f"{server.url}/admin/policy_version", json={"policy_version": "1"})
    assert text.status_code == 422 and "policy_version" in text.text
    assert httpx.post(f"{server.url}/admin/pause", json={"mode": "pause"}).status_code == 200
    busy = _switch(server.url, 1, "pause")  # a fence is closed: the trainer's own pause
    assert busy.status_code == 409 and "/admin/resume" in busy.text
    assert _switch(server.url, 1, "keep").status_code == 200  # no fence: allowed
    assert httpx.post(f"{server.url}/admin/resume").json()["policy_version"] == 1


def test_stream_whole_calls_assembles_the_answer_and_places_the_switch(
    make_app: MakeApp, live: Any, tmp_path: Path
) -> None:
    slow = Reply(text="w" * 40, event_delay_s=0.03)
    plain = make_app(lambda body: slow)
    server = live(plain.app)
    expected = httpx.post(f"{server.url}/v1/chat/completions", json=BODY, timeout=30).json()
    server.stop()
    h = make_app(lambda body: slow, stream_whole_calls=True, output=tmp_path / "assembled")
    server = live(h.app)
    answer: dict[str, Any] = {}

    def call() -> None:
        url = f"{server.url}/rollouts/w/v1/chat/completions"
        resp = httpx.post(url, json=BODY, timeout=30)
        answer["status"], answer["body"] = resp.status_code, resp.json()

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(0.5)
    assert _switch(server.url, 2).json()["in_flight_at_switch"] == 1
    caller.join(30)
    httpx.post(f"{server.url}/rollouts/w/finish")
    server.stop()
    assert answer["status"] == 200
    body = answer["body"]
    # The client gets a whole answer, as the backend would have answered it whole.
    assert body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["content"] == expected["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == expected["choices"][0]["finish_reason"]
    assert body["choices"][0]["logprobs"] is None and body["choices"][0]["token_ids"] is None
    sent = [r for r in h.backend.requests if r[1] == "/v1/chat/completions"]
    assert sent[-1][2] is not None and sent[-1][2]["stream"] is True
    (turn,) = _turns(h, "w")
    assert not turn.policy_switch_unlocated and len(turn.completion_token_ids) == 41
    (start, v0), (cut, v2) = turn.policy_version_spans
    assert (start, v0, v2) == (0, 0, 2) and 0 < cut < 41


@pytest.mark.parametrize(
    ("path", "extra", "reply"),
    [
        ("/v1/chat/completions", {"logprobs": True, "return_token_ids": True, "n": 2}, Reply()),
        ("/v1/chat/completions", {}, Reply()),
        ("/v1/chat/completions", {"return_token_ids": True}, TOOL_CALLS),
        ("/v1/completions", {"logprobs": 1, "return_token_ids": True}, Reply()),
        ("/v1/completions", {}, Reply(stop_reason="</answer>")),
    ],
    ids=[
        "chat-logprobs-n2",
        "chat",
        "chat-tool-calls-stop-token",
        "completions-logprobs",
        "completions-stop-string",
    ],
)
def test_an_assembled_answer_has_the_whole_answer_s_fields(
    make_app: MakeApp,
    live: Any,
    tmp_path: Path,
    path: str,
    extra: dict[str, Any],
    reply: Reply,
) -> None:
    request: dict[str, Any] = {**(BODY if "chat" in path else {"model": "fake-model"}), **extra}
    if "chat" not in path:
        request["prompt"] = "once upon"
    answers = []
    for n, assembled in enumerate((False, True)):
        h = make_app(lambda body: reply, stream_whole_calls=assembled, output=tmp_path / str(n))
        server = live(h.app)
        answers.append(httpx.post(f"{server.url}{path}", json=request, timeout=30).json())
        server.stop()
    whole, assembled_answer = answers
    for body in answers:
        body.pop("id"), body.pop("created")
    _assert_covers(whole, assembled_answer, "answer")
    if reply is TOOL_CALLS:  # the calls in their places, the stop token's id a number
        choice = assembled_answer["choices"][0]
        assert choice["message"]["tool_calls"] == TOOL_CALLS.tool_calls
        assert choice["stop_reason"] == 151645


def _assert_covers(whole: Any, assembled: Any, where: str) -> None:
    """Every value of the fake's whole answer is in the assembled one, equal. (The fake
    writes `tool_calls: []` where vLLM 0.32 writes none, and leaves out the nulls vLLM
    writes, e.g. `routed_experts`: the real-vLLM test compares the bytes' keys.)"""
    if isinstance(whole, dict):
        assert isinstance(assembled, dict), where
        for key, value in whole.items():
            if key == "tool_calls" and value == [] and key not in assembled:
                continue
            assert key in assembled, f"{where}.{key} is missing"
            _assert_covers(value, assembled[key], f"{where}.{key}")
    elif isinstance(whole, list):
        assert isinstance(assembled, list) and len(assembled) == len(whole), where
        for i, (a, b) in enumerate(zip(whole, assembled, strict=True)):
            _assert_covers(a, b, f"{where}[{i}]")
    else:
        assert whole == assembled, where


def test_pause_lets_turnstiles_calls_finish_before_it_pauses_the_backend(
    make_app: MakeApp, live: Any
) -> None:
    """With `backend_pause`, mode `pause` drains the calls in flight first, then pauses
    the engine: a call of ours must never wait inside a paused engine."""
    h = make_app(_slow_streams(), backend_pause=True)
    proxy = h.app.state.proxy
    in_flight_at_backend_pause: list[int] = []
    forward = h.backend.request

    async def request(method: str, path: str, body: Any, headers: Any) -> Any:
        if path.startswith("/pause"):
            in_flight_at_backend_pause.append(proxy.in_flight)
        return await forward(method, path, body, headers)

    h.backend.request = request  # type: ignore[method-assign]
    server = live(h.app)
    stream, out = _start_stream(f"{server.url}/rollouts/s/v1/chat/completions")
    time.sleep(0.4)
    paused = httpx.post(f"{server.url}/admin/pause", json={"mode": "pause"}, timeout=30)
    assert paused.status_code == 200 and paused.json()["in_flight_at_pause"] == 1
    assert in_flight_at_backend_pause == [0]
    stream.join(30)
    assert out["lines"][-1] == "data: [DONE]"
    assert httpx.post(f"{server.url}/admin/resume", json={"policy_version": 1}).status_code == 200
