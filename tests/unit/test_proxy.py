"""The proxy over the backend seam: transparency, exact recording, rollouts, errors."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import numpy as np
import openai
import orjson
import pytest
from starlette.testclient import TestClient

from tests.fakes_backend import EOT, FakeVLLM, Reply, ids_of, logprob, render
from tests.unit.conftest import MakeApp
from turnstile.records import BreakKind, RolloutStatus, TokenSource, TurnStatus

USER = [{"role": "user", "content": "What is 2+2?"}]


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": USER, **extra}


def direct(backend: FakeVLLM, path: str, body: dict[str, Any]) -> Any:
    """What the backend itself answers to the client's unmodified request."""
    resp = asyncio.run(backend.request("POST", path, orjson.dumps(body), {}))
    raw = asyncio.run(resp.read())
    if body.get("stream"):
        return raw
    return orjson.loads(raw)


def test_non_streaming_response_is_what_the_backend_would_return(make_app: MakeApp) -> None:
    h = make_app()
    with TestClient(h.app) as client:
        resp = client.post("/v1/chat/completions", json=chat_body(temperature=0.5))
        assert resp.status_code == 200
        got = resp.json()
    assert got == direct(FakeVLLM(), "/v1/chat/completions", chat_body(temperature=0.5))
    assert got["prompt_token_ids"] is None and got["choices"][0]["logprobs"] is None
    # ... while the backend was asked for what Turnstile records
    sent = h.backend.requests[-1][2]
    assert sent is not None
    assert sent["return_token_ids"] is True and sent["logprobs"] is True
    (turn,) = h.sink.turns
    assert turn.status is TurnStatus.OK and turn.token_source is TokenSource.BACKEND
    assert turn.prompt_token_ids.tolist() == ids_of(render(USER))
    assert turn.completion_token_ids.tolist() == [*ids_of("hello"), EOT]
    assert turn.behavior_logprobs.dtype == np.float32
    assert turn.behavior_logprobs.tolist() == [
        np.float32(logprob(i)) for i in range(len(turn.completion_token_ids))
    ]
    assert json.loads(turn.sampling_params_json) == {"temperature": 0.5}
    assert json.loads(turn.response_message_json or "") == {"role": "assistant", "content": "hello"}
    assert turn.finish_reason == "stop" and turn.http_status == 200


def test_client_that_asks_for_logprobs_and_ids_gets_them(make_app: MakeApp) -> None:
    h = make_app()
    body = chat_body(logprobs=True, top_logprobs=2, return_token_ids=True)
    with TestClient(h.app) as client:
        got = client.post("/v1/chat/completions", json=body).json()
    assert got == direct(FakeVLLM(), "/v1/chat/completions", body)
    assert got["choices"][0]["token_ids"] == [*ids_of("hello"), EOT]


def test_top_logprobs_recorded_as_ids_when_configured(make_app: MakeApp) -> None:
    h = make_app(top_logprobs=3)
    with TestClient(h.app) as client:
        got = client.post("/v1/chat/completions", json=chat_body()).json()
    assert got["choices"][0]["logprobs"] is None
    (turn,) = h.sink.turns
    ids = turn.completion_token_ids.tolist()
    assert turn.top_logprob_ids is not None and turn.top_logprob_values is not None
    assert [row[0] for row in turn.top_logprob_ids] == ids
    assert all(len(row) == 3 for row in turn.top_logprob_ids)


def test_streaming_with_the_openai_client(make_app: MakeApp, live: Any) -> None:
    h = make_app()
    server = live(h.app)
    client = openai.OpenAI(base_url=server.url + "/rollouts/s1/v1", api_key="unused")
    chunks: list[Any] = list(
        client.chat.completions.create(model="fake-model", messages=USER, stream=True)  # type: ignore[arg-type]
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "hello"
    for c in chunks:
        assert (c.model_extra or {}).get("prompt_token_ids") is None
        for ch in c.choices:
            assert (ch.model_extra or {}).get("token_ids") is None
            assert ch.logprobs is None
    raw = httpx.post(server.url + "/v1/chat/completions", json=chat_body(stream=True)).content
    assert raw == direct(FakeVLLM(), "/v1/chat/completions", chat_body(stream=True))
    server.__exit__()
    turns = [t for t in h.sink.turns if t.rollout_id == "s1"]
    assert len(turns) == 1
    assert turns[0].completion_token_ids.tolist() == [*ids_of("hello"), EOT]
    assert turns[0].timings.ttft_s is not None and turns[0].timings.ttft_s >= 0


def test_stream_is_relayed_event_by_event(make_app: MakeApp, live: Any) -> None:
    h = make_app(lambda body: Reply(text="abcdef", event_delay_s=0.05))
    server = live(h.app)
    arrivals: list[float] = []
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=chat_body(stream=True)
    ) as resp:
        for _ in resp.iter_raw():
            arrivals.append(time.monotonic())
    assert len(arrivals) >= 6  # one write per event, not one buffered body
    assert arrivals[-1] - arrivals[0] > 0.2


def test_multi_turn_rollout_stitches_exactly(make_app: MakeApp) -> None:
    replies = iter(["first answer", "second answer", "third"])
    h = make_app(lambda body: Reply(text=next(replies)))
    with TestClient(h.app) as client:
        created = client.post(
            "/rollouts", json={"group_id": "g", "task_id": "t", "metadata": {"k": 1}}
        )
        assert created.status_code == 201
        rid = created.json()["rollout_id"]
        base = created.json()["base_url"]
        assert base.endswith(f"/rollouts/{rid}/v1")
        messages: list[dict[str, Any]] = list(USER)
        for i in range(3):
            stream = i == 1
            resp = client.post(
                f"/rollouts/{rid}/v1/chat/completions",
                json={"model": "m", "messages": messages, "stream": stream},
            )
            assert resp.status_code == 200
            if stream:
                text = "".join(
                    (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("content")
                    or ""
                    for line in resp.text.split("\n")
                    if line.startswith("data: {")
                )
            else:
                text = resp.json()["choices"][0]["message"]["content"]
            messages += [
                {"role": "assistant", "content": text},
                {"role": "tool", "content": f"result {i}", "tool_call_id": "x"},
            ]
        assert (
            client.post(f"/rollouts/{rid}/rewards", json={"rewards": {"correct": 1.0}}).status_code
            == 200
        )
        fin = client.post(
            f"/rollouts/{rid}/finish",
            json={"rewards": {"format": 0.5}, "info": {"format": {"why": "ok"}}},
        )
        assert fin.status_code == 200 and fin.json()["status"] == "finished"
        assert (
            client.post(f"/rollouts/{rid}/v1/chat/completions", json=chat_body()).status_code == 409
        )
        assert (
            client.post(f"/rollouts/{rid}/rewards", json={"rewards": {"late": 1.0}}).status_code
            == 409
        )
        state = client.get(f"/rollouts/{rid}").json()
        assert state["num_turns"] == 3 and state["rewards"]["format"]["info"] == '{"why":"ok"}'
    (sample,) = h.sink.samples
    turns = sorted(h.sink.turns, key=lambda t: t.turn_index)
    expected = np.concatenate([turns[-1].prompt_token_ids, turns[-1].completion_token_ids])
    assert np.array_equal(sample.input_ids, expected)
    mask_positions = np.nonzero(sample.loss_mask)[0]
    sampled = np.concatenate([t.completion_token_ids for t in turns])
    assert np.array_equal(sample.input_ids[mask_positions], sampled)
    assert np.array_equal(
        sample.behavior_logprobs[mask_positions],
        np.concatenate([t.behavior_logprobs for t in turns]),
    )
    assert {r.name: r.value for r in sample.rewards} == {"correct": 1.0, "format": 0.5}
    assert sample.group_id == "g" and sample.break_kind is BreakKind.FIRST
    (rollout,) = h.sink.rollouts
    assert rollout.status is RolloutStatus.FINISHED and rollout.num_turns == 3
    assert rollout.num_samples == 1 and rollout.num_breaks == 0


def test_history_rewrite_is_split_not_merged(make_app: MakeApp) -> None:
    h = make_app()
    with TestClient(h.app) as client:
        headers = {"X-Turnstile-Rollout": "hdr-1"}
        client.post("/v1/chat/completions", json=chat_body(), headers=headers)
        edited = [
            *USER,
            {"role": "assistant", "content": "something else"},
            {"role": "user", "content": "again"},
        ]
        client.post(
            "/v1/chat/completions", json={"model": "m", "messages": edited}, headers=headers
        )
        client.post("/rollouts/hdr-1/finish")
    _first, second = h.sink.samples
    assert second.break_kind is BreakKind.HISTORY_REWRITTEN
    assert second.parent_sample_index == 0 and second.break_position is not None
    assert h.sink.rollouts[0].num_breaks == 1


def test_requests_without_a_rollout_are_one_turn_rollouts(make_app: MakeApp) -> None:
    h = make_app()
    with TestClient(h.app) as client:
        for _ in range(2):
            client.post("/v1/chat/completions", json=chat_body(n=2))
    assert len(h.sink.turns) == 4 and len(h.sink.rollouts) == 2
    assert {t.choice_index for t in h.sink.turns} == {0, 1}
    kinds = sorted(s.break_kind.value for s in h.sink.samples)
    assert kinds == ["branch", "branch", "first", "first"]


def test_completions_endpoint_is_recorded(make_app: MakeApp) -> None:
    h = make_app()
    body = {"model": "m", "prompt": "Once upon", "max_tokens": 5}
    with TestClient(h.app) as client:
        got = client.post("/v1/completions", json=body).json()
    assert got == direct(FakeVLLM(), "/v1/completions", body)
    (turn,) = h.sink.turns
    assert turn.endpoint == "completions"
    assert turn.prompt_token_ids.tolist() == ids_of("Once upon")
    assert turn.response_text == "hello"
    assert not np.isnan(turn.behavior_logprobs).any()


@pytest.mark.parametrize(
    ("raw", "status", "needle"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 422, "JSON object"),
        (b'{"model": "m"}', 422, "messages"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}', 422, "'n'"),
    ],
)
def test_bad_requests_get_openai_errors(
    make_app: MakeApp, raw: bytes, status: int, needle: str
) -> None:
    h = make_app()
    with TestClient(h.app) as client:
        resp = client.post(
            "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}
        )
    assert resp.status_code == status
    err = resp.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    assert h.backend.requests[1:] == []  # nothing reached the backend


@pytest.mark.parametrize(
    ("reply", "status"),
    [
        (Reply(status=400), 400),
        (Reply(status=429), 429),
        (Reply(fail="unreachable"), 502),
        (Reply(fail="timeout"), 504),
    ],
)
def test_backend_failures_are_relayed_and_recorded(
    make_app: MakeApp, reply: Reply, status: int
) -> None:
    h = make_app(lambda body: reply)
    with TestClient(h.app) as client:
        resp = client.post("/v1/chat/completions", json=chat_body())
    assert resp.status_code == status
    assert "message" in resp.json()["error"]
    (turn,) = h.sink.turns
    assert turn.status is TurnStatus.ERROR and turn.http_status == status
    assert turn.error and turn.token_source is TokenSource.NONE


def test_backend_dying_mid_stream(make_app: MakeApp) -> None:
    h = make_app(lambda body: Reply(text="abcdefgh", die_after_events=4))
    with TestClient(h.app) as client:
        resp = client.post("/v1/chat/completions", json=chat_body(stream=True))
    events = [line[6:] for line in resp.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "error" in json.loads(events[-2])
    (turn,) = h.sink.turns
    assert turn.status is TurnStatus.ABORTED
    assert turn.completion_token_ids.tolist() == ids_of("abc")  # the 3 tokens relayed
    assert "mid-response" in (turn.error or "")


def test_client_disconnect_cancels_upstream_and_records(make_app: MakeApp, live: Any) -> None:
    h = make_app(lambda body: Reply(text="x" * 200, event_delay_s=0.02))
    server = live(h.app)
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=chat_body(stream=True)
    ) as resp:
        for i, _ in enumerate(resp.iter_raw()):
            if i == 3:
                break
    deadline = time.monotonic() + 5
    upstream = h.backend.responses[-1]
    while not upstream.closed and time.monotonic() < deadline:
        time.sleep(0.02)
    assert upstream.closed, "the upstream request was not cancelled"
    assert upstream.sent < 100
    server.__exit__()
    (turn,) = h.sink.turns
    assert turn.status is TurnStatus.ABORTED and turn.error == "client disconnected"
    assert 0 < len(turn.completion_token_ids) < 201


def test_body_limit_413_with_length_and_chunked(make_app: MakeApp) -> None:
    h = make_app(max_request_body_bytes=1000)
    big = orjson.dumps(chat_body(pad="x" * 2000))
    with TestClient(h.app) as client:
        assert client.post("/v1/chat/completions", content=big).status_code == 413

        def gen() -> Any:
            for i in range(0, len(big), 100):
                yield big[i : i + 100]

        resp = client.post("/v1/chat/completions", content=gen())
        assert resp.status_code == 413
        assert "limit" in resp.json()["error"]["message"]
    assert h.sink.turns == []


def test_policy_version_admin_and_header(make_app: MakeApp) -> None:
    h = make_app(policy_version=2)
    with TestClient(h.app) as client:
        client.post("/v1/chat/completions", json=chat_body())
        switched = client.post("/admin/policy_version", json={"policy_version": 7}).json()
        assert switched["policy_version"] == 7
        assert switched["mode"] == "keep"
        client.post("/v1/chat/completions", json=chat_body())
        client.post(
            "/v1/chat/completions", json=chat_body(), headers={"X-Turnstile-Policy-Version": "9"}
        )
        bad = client.post(
            "/v1/chat/completions", json=chat_body(), headers={"X-Turnstile-Policy-Version": "nine"}
        )
        assert bad.status_code == 400
    assert sorted(t.policy_version for t in h.sink.turns) == [2, 7, 9]


def test_passthrough_and_health(make_app: MakeApp) -> None:
    h = make_app()
    with TestClient(h.app) as client:
        models = client.get("/v1/models").json()
        assert models["data"][0]["id"] == "fake-model"
        assert client.post("/tokenize", json={"prompt": "x"}).json()["path"] == "/tokenize"
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        missing = client.get("/nope")
        assert missing.status_code == 404 and "error" in missing.json()
        assert client.get("/rollouts/unknown").status_code == 404
        assert client.post("/rollouts/bad id!/finish").status_code in (400, 404)
        assert client.post("/rollouts", json={"rollout_id": "dup"}).status_code == 201
        assert client.post("/rollouts", json={"rollout_id": "dup"}).status_code == 409
        assert client.post("/rollouts/dup/rewards", json={"rewards": {"a": "x"}}).status_code == 422


def test_shutdown_publishes_everything_and_seals_open_rollouts(make_app: MakeApp) -> None:
    h = make_app()
    with TestClient(h.app) as client:
        for _ in range(3):
            client.post("/rollouts/open-1/v1/chat/completions", json=chat_body())
    assert len(h.sink.turns) == 3 and h.sink.closed
    (rollout,) = h.sink.rollouts
    assert rollout.status is RolloutStatus.INTERRUPTED
    assert h.sink.samples[0].rollout_status is RolloutStatus.INTERRUPTED


def test_backend_without_token_ids_is_flagged(
    make_app: MakeApp, caplog: pytest.LogCaptureFixture
) -> None:
    h = make_app(lambda body: Reply(no_token_ids=True))
    with TestClient(h.app) as client:
        resp = client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 200
    (turn,) = h.sink.turns
    assert turn.token_source is TokenSource.NONE
    assert "no token IDs" in caplog.text


@pytest.mark.parametrize("stream", [False, True])
def test_sdk_retries_replay_the_answer_and_record_once(make_app: MakeApp, stream: bool) -> None:
    h = make_app()
    body = chat_body(stream=stream)
    with TestClient(h.app) as client:
        first = client.post(
            "/rollouts/r/v1/chat/completions", json=body, headers={"x-stainless-retry-count": "0"}
        )
        retry = client.post(
            "/rollouts/r/v1/chat/completions", json=body, headers={"x-stainless-retry-count": "1"}
        )
        assert retry.content == first.content and retry.status_code == 200
        assert retry.headers["X-Turnstile-Replayed"] == "true"
        other = client.post(
            "/rollouts/r/v1/chat/completions",
            json=chat_body(stream=stream, n=2),
            headers={"x-stainless-retry-count": "1"},
        )
        assert "X-Turnstile-Replayed" not in other.headers
        keyed = [
            client.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": "k1"})
            for _ in range(2)
        ]
        assert keyed[0].content == keyed[1].content
        # without retry headers, identical prompts are separate samples (GRPO groups)
        client.post("/v1/chat/completions", json=body)
        client.post("/v1/chat/completions", json=body)
    chat_calls = [r for r in h.backend.requests if r[1] == "/v1/chat/completions"]
    assert len(chat_calls) == 5
    assert len({t.turn_id for t in h.sink.turns}) == 5


def test_retry_of_a_failed_call_is_a_new_call(make_app: MakeApp) -> None:
    replies = iter([Reply(status=500), Reply()])
    h = make_app(lambda body: next(replies))
    with TestClient(h.app) as client:
        assert (
            client.post(
                "/v1/chat/completions", json=chat_body(), headers={"x-stainless-retry-count": "0"}
            ).status_code
            == 500
        )
        assert (
            client.post(
                "/v1/chat/completions", json=chat_body(), headers={"x-stainless-retry-count": "1"}
            ).status_code
            == 200
        )
    assert sorted(t.status.value for t in h.sink.turns) == ["error", "ok"]
