"""`POST /v1/messages` through the real `anthropic` SDK: translated to the backend's chat
route, recorded as one chat turn with its exact tokens, answered in Messages' shape (whole
and streamed, with tools, thinking and tool results), errors in Anthropic's own shape."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest
from starlette.testclient import TestClient

from tests.fakes_backend import EOT, Reply, ids_of, render
from tests.unit.conftest import Harness, MakeApp
from turnstile.records import TokenSource, TurnStatus

MODEL = "fake-model"
MESSAGES_BODY: Any = {
    "model": MODEL,
    "max_tokens": 8,
    "messages": [{"role": "user", "content": "hi"}],
}
CALL: Any = {
    "id": "toolu_1",
    "type": "function",
    "function": {"name": "add", "arguments": '{"a": 1}'},
}
TOOL: Any = {
    "name": "add",
    "description": "adds",
    "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
}


def client_of(http: TestClient) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=str(http.base_url), api_key="k", http_client=http, max_retries=0
    )


def sent_chat(h: Harness) -> dict[str, Any]:
    method, path, body, _ = h.backend.requests[-1]
    assert (method, path) == ("POST", "/v1/chat/completions") and body is not None
    return body


def test_a_whole_answer_is_one_recorded_chat_turn(make_app: MakeApp) -> None:
    h = make_app()
    system: Any = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=ab12;"}]
    system += [{"type": "text", "text": "Be brief."}]
    with TestClient(h.app) as http:
        message = client_of(http).messages.create(
            model=MODEL,
            max_tokens=32,
            system=system,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"temperature": 0.5},
        )
    assert message.type == "message" and message.role == "assistant"
    assert [(b.type, getattr(b, "text", None)) for b in message.content] == [("text", "hello")]
    assert message.stop_reason == "end_turn" and message.model == MODEL
    chat_messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert message.usage.input_tokens == len(render(chat_messages))
    assert message.usage.output_tokens == len("hello") + 1
    sent = sent_chat(h)
    assert sent["messages"] == chat_messages  # the billing header's hash is not rendered
    assert sent["max_tokens"] == 32 and sent["temperature"] == 0.5
    (turn,) = h.sink.turns
    assert turn.status is TurnStatus.OK and turn.token_source is TokenSource.BACKEND
    assert turn.endpoint == "chat.completions"
    assert turn.prompt_token_ids.tolist() == ids_of(render(chat_messages))
    assert turn.completion_token_ids.tolist() == [*ids_of("hello"), EOT]
    assert json.loads(turn.request_messages_json or "") == chat_messages


def test_history_with_thinking_tools_and_results_translates_as_vllm_does(
    make_app: MakeApp,
) -> None:
    h = make_app(lambda body: Reply(text="", tool_calls=[CALL], finish_reason="tool_calls"))
    history: list[Any] = [
        {"role": "user", "content": [{"type": "text", "text": "add one"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "use the tool", "signature": "s"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "toolu_0", "name": "add", "input": {"a": 0}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_0",
                    "content": [{"type": "text", "text": "1"}],
                },
                {"type": "text", "text": "again"},
            ],
        },
    ]
    with TestClient(h.app) as http:
        message = client_of(http).messages.create(
            model=MODEL,
            max_tokens=16,
            messages=history,
            tools=[TOOL],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            stop_sequences=["END"],
        )
    sent = sent_chat(h)
    assert sent["messages"] == [
        {"role": "user", "content": "add one"},
        {
            "role": "assistant",
            "content": "calling",
            "reasoning": "use the tool",
            "tool_calls": [
                {
                    "id": "toolu_0",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 0}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_0", "content": "1"},
        {"role": "user", "content": "again"},
    ]
    assert sent["tools"] == [
        {
            "type": "function",
            "function": {"name": "add", "parameters": TOOL["input_schema"], "description": "adds"},
        }
    ]
    assert sent["tool_choice"] == "required" and sent["parallel_tool_calls"] is False
    assert sent["stop"] == ["END"]
    (block,) = message.content
    assert block.type == "tool_use" and block.id == "toolu_1" and block.name == "add"
    assert block.input == {"a": 1}
    assert message.stop_reason == "tool_use"
    (turn,) = h.sink.turns
    assert turn.status is TurnStatus.OK
    assert turn.prompt_token_ids.tolist() == ids_of(render(sent["messages"]))


def test_a_streamed_answer_has_thinking_text_and_tool_blocks(make_app: MakeApp) -> None:
    reply = Reply(text="ok", reasoning="hmm", tool_calls=[CALL], finish_reason="tool_calls")
    h = make_app(lambda body: reply)
    with (
        TestClient(h.app) as http,
        client_of(http).messages.stream(
            model=MODEL,
            max_tokens=16,
            messages=[{"role": "user", "content": "hi"}],
            tools=[TOOL],
        ) as stream,
    ):
        events = list(stream)
        final = stream.get_final_message()
    kinds = [
        e.type for e in events if e.type not in ("text", "thinking", "input_json", "signature")
    ]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    deltas = {e.delta.type for e in events if e.type == "content_block_delta"}
    assert {"thinking_delta", "signature_delta", "text_delta", "input_json_delta"} <= deltas
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    blocks = [b.model_dump() for b in final.content]
    assert blocks[0]["thinking"] == "hmm" and blocks[1]["text"] == "ok"
    assert blocks[2]["input"] == {"a": 1}
    assert final.stop_reason == "tool_use"
    assert final.usage.output_tokens == len("ok") + 1
    assert final.usage.input_tokens == len(render([{"role": "user", "content": "hi"}]))
    sent = sent_chat(h)
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    (turn,) = h.sink.turns
    assert turn.status is TurnStatus.OK and turn.token_source is TokenSource.BACKEND
    assert turn.completion_token_ids.tolist() == [*ids_of("ok"), EOT]
    recorded = json.loads(turn.response_message_json or "")
    assert recorded["reasoning"] == "hmm" and recorded["tool_calls"][0]["id"] == "toolu_1"


def test_count_tokens_asks_the_backend_and_records_nothing(make_app: MakeApp) -> None:
    h = make_app()
    with TestClient(h.app) as http:
        counted = client_of(http).messages.count_tokens(
            model=MODEL, system="sys", messages=[{"role": "user", "content": "hi"}]
        )
    chat_messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    assert counted.input_tokens == len(render(chat_messages))
    assert h.backend.requests[-1][1] == "/tokenize"
    assert h.sink.turns == []


@pytest.mark.parametrize(
    ("content", "status", "needle"),
    [
        ([{"type": "image", "source": {"type": "file", "file_id": "file_1"}}], 422, "image"),
        ([{"type": "tool_use", "id": "t", "name": "n", "input": {}}], 422, "tool_use"),
        (7, 400, "messages[0].content"),
    ],
)
def test_requests_that_cannot_be_translated_are_refused_and_not_recorded(
    make_app: MakeApp, content: Any, status: int, needle: str
) -> None:
    h = make_app()
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": content}]}
    with TestClient(h.app) as http:
        resp = http.post("/v1/messages", json=body)
        assert resp.status_code == status
        error = resp.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert needle in error["error"]["message"]
        assert h.app.state.proxy.in_flight == 0
    assert h.sink.turns == [] and h.backend.requests[1:] == []


def test_missing_max_tokens_and_bad_json_are_400(make_app: MakeApp) -> None:
    h = make_app()
    with TestClient(h.app) as http:
        resp = http.post(
            "/v1/messages", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        )
        assert resp.status_code == 400 and "max_tokens" in resp.json()["error"]["message"]
        resp = http.post("/v1/messages", content=b"{not json")
        assert resp.status_code == 400 and resp.json()["type"] == "error"
    assert h.sink.turns == []


def test_a_backend_error_is_relayed_in_anthropic_shape(make_app: MakeApp) -> None:
    h = make_app(lambda body: Reply(status=400))
    with TestClient(h.app) as http, pytest.raises(anthropic.BadRequestError) as caught:
        client_of(http).messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.status_code == 400
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "bad thing"},
    }
    (turn,) = h.sink.turns
    assert turn.status is TurnStatus.ERROR and turn.http_status == 400


def test_a_stream_cut_mid_way_ends_in_an_error_event(make_app: MakeApp) -> None:
    h = make_app(lambda body: Reply(text="hello world", die_after_events=4))
    with TestClient(h.app) as http:
        resp = http.post(
            "/v1/messages",
            json={
                "model": MODEL,
                "max_tokens": 8,
                "stream": True,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
    events = [block for block in resp.text.split("\n\n") if block]
    assert events[0].startswith("event: message_start")
    assert events[-1].startswith("event: error")
    error = json.loads(events[-1].split("data: ", 1)[1])
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert not any(e.startswith("event: message_stop") for e in events)
    (turn,) = h.sink.turns
    assert turn.status is TurnStatus.ABORTED


def test_several_text_blocks_are_joined_as_vllm_joins_them(make_app: MakeApp) -> None:
    h = make_app()
    blocks = [{"type": "text", "text": "<reminder>"}, {"type": "text", "text": "do it"}]
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": blocks}]}
    with TestClient(h.app) as http:
        assert http.post("/v1/messages", json=body).status_code == 200
    assert sent_chat(h)["messages"] == [{"role": "user", "content": "<reminder>\ndo it"}]


def test_the_message_validates_strictly_against_the_sdk_model(make_app: MakeApp) -> None:
    reply = Reply(text="ok", reasoning="hm", tool_calls=[CALL], finish_reason="tool_calls")
    h = make_app(lambda body: reply)
    body = {**MESSAGES_BODY, "tools": [TOOL]}
    with TestClient(h.app) as http:
        resp = http.post("/v1/messages", json=body)
    message = anthropic.types.Message.model_validate(resp.json())
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
