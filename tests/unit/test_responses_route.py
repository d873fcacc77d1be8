"""`POST /v1/responses` through the real `openai` SDK: translated to the backend's chat
route, recorded as one chat turn with its exact tokens, answered in Responses' shape (whole
and streamed with sequence numbers, with function calls and reasoning), and
`previous_response_id` chains that survive a restart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from starlette.testclient import TestClient

from tests.fakes_backend import EOT, Reply, ids_of, render
from tests.unit.conftest import Harness, MakeApp
from turnstile.records import TokenSource, TurnStatus

MODEL = "fake-model"
CALL: Any = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "add", "arguments": '{"a": 1}'},
}
TOOL: Any = {
    "type": "function",
    "name": "add",
    "description": "adds",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
}


def client_of(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{http.base_url}/v1", api_key="k", http_client=http, max_retries=0
    )


def sent_chat(h: Harness) -> dict[str, Any]:
    method, path, body, _ = h.backend.requests[-1]
    assert (method, path) == ("POST", "/v1/chat/completions") and body is not None
    return body


def test_a_whole_answer_is_one_recorded_chat_turn(make_app: MakeApp) -> None:
    h = make_app()
    with TestClient(h.app) as http:
        response = client_of(http).responses.create(
            model=MODEL,
            instructions="Be brief.",
            input=[
                {"role": "developer", "content": "env: linux"},
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            ],
            max_output_tokens=32,
            temperature=0.5,
        )
    assert response.object == "response" and response.status == "completed"
    assert response.output_text == "hello" and response.model == MODEL
    assert response.id.startswith("resp_") and response.instructions == "Be brief."
    chat_messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "env: linux"},
        {"role": "user", "content": "hi"},
    ]
    assert response.usage is not None
    assert response.usage.input_tokens == len(render(chat_messages))
    assert response.usage.output_tokens == len("hello") + 1
    sent = sent_chat(h)
    assert sent["messages"] == chat_messages
    assert sent["max_tokens"] == 32 and sent["temperature"] == 0.5
    (turn,) = h.sink.turns
    assert turn.status is TurnStatus.OK and turn.token_source is TokenSource.BACKEND
    assert turn.prompt_token_ids.tolist() == ids_of(render(chat_messages))
    assert turn.completion_token_ids.tolist() == [*ids_of("hello"), EOT]


def test_function_calls_and_their_outputs_round_trip(make_app: MakeApp) -> None:
    replies = iter(
        [
            Reply(text="", reasoning="think", tool_calls=[CALL], finish_reason="tool_calls"),
            Reply(text="two"),
        ]
    )
    h = make_app(lambda body: next(replies))
    with TestClient(h.app) as http:
        client = client_of(http)
        first = client.responses.create(model=MODEL, input="add one", tools=[TOOL])
        assert [item.type for item in first.output] == ["reasoning", "function_call"]
        call = first.output[1]
        assert call.type == "function_call"
        assert (call.call_id, call.name, call.arguments) == ("call_1", "add", '{"a": 1}')
        assert sent_chat(h)["tools"] == [
            {
                "type": "function",
                "function": {
                    "name": "add",
                    "description": "adds",
                    "parameters": TOOL["parameters"],
                },
            }
        ]
        # The harness sends the whole conversation back, our items included (Codex's way).
        history: Any = [
            {"role": "user", "content": "add one"},
            *[item.model_dump(exclude_none=True) for item in first.output],
            {"type": "function_call_output", "call_id": "call_1", "output": "2"},
        ]
        second = client.responses.create(model=MODEL, input=history, tools=[TOOL], store=False)
    assert second.output_text == "two"
    assert sent_chat(h)["messages"] == [
        {"role": "user", "content": "add one"},
        {
            "role": "assistant",
            "content": None,
            "reasoning": "think",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "2"},
    ]
    first_turn, second_turn = sorted(h.sink.turns, key=lambda t: t.timings.received_at)
    assert first_turn.status is second_turn.status is TurnStatus.OK


def test_a_streamed_answer_has_numbered_events_in_the_responses_grammar(
    make_app: MakeApp,
) -> None:
    reply = Reply(text="ok", reasoning="hm", tool_calls=[CALL], finish_reason="tool_calls")
    h = make_app(lambda body: reply)
    with (
        TestClient(h.app) as http,
        client_of(http).responses.stream(
            model=MODEL,
            input="hi",
            tools=[TOOL],
        ) as stream,
    ):
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for needed in (
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ):
        assert needed in kinds, needed
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "ok"
    assert final.output[2].model_dump()["arguments"] == '{"a": 1}'
    assert final.usage is not None and final.usage.output_tokens == len("ok") + 1
    (turn,) = h.sink.turns
    assert turn.status is TurnStatus.OK
    assert turn.completion_token_ids.tolist() == [*ids_of("ok"), EOT]


def test_previous_response_id_chains_survive_a_restart(make_app: MakeApp, tmp_path: Path) -> None:
    h = make_app()
    with TestClient(h.app) as http:
        first = client_of(http).responses.create(model=MODEL, instructions="old", input="hi")
    again = make_app()  # a new process over the same output directory
    with TestClient(again.app) as http:
        client = client_of(http)
        second = client.responses.create(
            model=MODEL, instructions="new", input="more", previous_response_id=first.id
        )
        assert sent_chat(again)["messages"] == [
            {"role": "system", "content": "new"},  # instructions do not carry over
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "more"},
        ]
        client.responses.create(model=MODEL, input="last", previous_response_id=second.id)
        assert [m["content"] for m in sent_chat(again)["messages"]] == [
            "hi",
            "hello",
            "more",
            "hello",
            "last",
        ]
    assert (tmp_path / "out" / "responses" / "conversations.jsonl").exists()


def test_an_unknown_previous_response_is_400_and_not_recorded(make_app: MakeApp) -> None:
    h = make_app()
    with TestClient(h.app) as http:
        with pytest.raises(openai.BadRequestError) as caught:
            client_of(http).responses.create(
                model=MODEL, input="x", previous_response_id="resp_nope"
            )
        assert h.app.state.proxy.in_flight == 0
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["code"] == "previous_response_not_found"
    assert error["param"] == "previous_response_id"
    assert h.sink.turns == [] and h.backend.requests[1:] == []


@pytest.mark.parametrize(
    ("item", "status"),
    [
        ({"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}, 422),
        ({"type": "item_reference", "id": "msg_1"}, 422),
        ({"type": "function_call", "call_id": 3, "name": "f", "arguments": "{}"}, 400),
        ({"role": "wizard", "content": "x"}, 400),
    ],
)
def test_input_that_cannot_be_translated_is_refused(
    make_app: MakeApp, item: dict[str, Any], status: int
) -> None:
    h = make_app()
    with TestClient(h.app) as http:
        resp = http.post("/v1/responses", json={"model": MODEL, "input": [item]})
        assert resp.status_code == status, resp.text
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert h.sink.turns == []


def test_a_stream_cut_mid_way_ends_in_error_and_response_failed(make_app: MakeApp) -> None:
    h = make_app(lambda body: Reply(text="hello world", die_after_events=4))
    with TestClient(h.app) as http:
        resp = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "stream": True})
    events = [json.loads(b.split("data: ", 1)[1]) for b in resp.text.split("\n\n") if b]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["status"] == "failed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    (turn,) = h.sink.turns
    assert turn.status is TurnStatus.ABORTED


def test_an_answer_cut_at_max_output_tokens_is_completed_as_incomplete(
    make_app: MakeApp,
) -> None:
    h = make_app(lambda body: Reply(text="abc", finish_reason="length"))
    with TestClient(h.app) as http:
        client = client_of(http)
        whole = client.responses.create(model=MODEL, input="hi", max_output_tokens=4)
        with client.responses.stream(model=MODEL, input="hi", max_output_tokens=4) as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_response()
    for response in (whole, streamed):
        assert response.status == "incomplete"
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
        assert response.output_text == "abc"
    assert kinds[-1] == "response.completed" and "response.incomplete" not in kinds


def test_several_text_parts_are_joined_as_vllm_joins_them(make_app: MakeApp) -> None:
    h = make_app()
    parts = [{"type": "input_text", "text": "<env>"}, {"type": "input_text", "text": "do it"}]
    output = [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    items = [
        {"role": "user", "content": parts},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": output},
    ]
    with TestClient(h.app) as http:
        assert http.post("/v1/responses", json={"model": MODEL, "input": items}).status_code == 200
    messages = sent_chat(h)["messages"]
    assert messages[0] == {"role": "user", "content": "<env>\ndo it"}
    assert messages[2] == {"role": "tool", "tool_call_id": "c", "content": "a\nb"}


def test_the_response_object_validates_strictly_against_the_sdk_model(
    make_app: MakeApp,
) -> None:
    reply = Reply(text="ok", reasoning="hm", tool_calls=[CALL], finish_reason="tool_calls")
    h = make_app(lambda body: reply)
    with TestClient(h.app) as http:
        resp = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "tools": [TOOL]})
    response = openai.types.responses.Response.model_validate(resp.json())
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]


def test_namespace_tools_are_flattened_as_vllm_flattens_them(make_app: MakeApp) -> None:
    spawn: dict[str, Any] = {"id": "call_s", "type": "function"}
    spawn["function"] = {"name": "agents__spawn", "arguments": '{"task": "x"}'}
    h = make_app(lambda body: Reply(text="", tool_calls=[spawn], finish_reason="tool_calls"))
    namespace = {
        "type": "namespace",
        "name": "agents",
        "description": "sub-agents",
        "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object"}}],
    }
    tools = [namespace, {"type": "web_search"}, TOOL]
    with TestClient(h.app) as http:
        first = http.post("/v1/responses", json={"model": MODEL, "input": "go", "tools": tools})
        assert [t["function"]["name"] for t in sent_chat(h)["tools"]] == ["agents__spawn", "add"]
        (item,) = first.json()["output"]
        assert (item["name"], item["namespace"]) == ("spawn", "agents")
        assert openai.types.responses.Response.model_validate(first.json())
        items = [{"role": "user", "content": "go"}, item]
        items.append({"type": "function_call_output", "call_id": "call_s", "output": "done"})
        with client_of(http).responses.stream(model=MODEL, input=items, tools=tools) as stream:
            final = stream.get_final_response()
    calls = sent_chat(h)["messages"][1]["tool_calls"]
    assert calls[0]["function"]["name"] == "agents__spawn"
    (streamed,) = final.output
    assert streamed.model_dump()["namespace"] == "agents"
