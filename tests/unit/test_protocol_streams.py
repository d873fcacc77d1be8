"""Recorded vLLM chat streams through each protocol's translator, bytes split anywhere:
every event validates against the protocol's own SDK types, in its grammar's order."""

from __future__ import annotations

import typing
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import orjson
import pydantic
import pytest

from turnstile.protocols.common import StreamTranslator, translate_stream
from turnstile.protocols.messages import MessagesCall
from turnstile.protocols.messages_stream import MessagesStream
from turnstile.protocols.responses import ResponsesCall
from turnstile.protocols.responses_stream import ResponsesStream
from turnstile.proxy.sse import SSEParser

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
ANTHROPIC_EVENT: Any = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
_RESPONSES_EVENTS: dict[str, Any] = {
    typing.get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in typing.get_args(typing.get_args(openai.types.responses.ResponseStreamEvent)[0])
}


def check_responses_event(event: dict[str, Any]) -> None:
    """`event` validates against the `openai` SDK's model of its type."""
    _RESPONSES_EVENTS[event["type"]].model_validate(event)


def recorded(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


async def _pieces(raw: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(raw), size):
        yield raw[start : start + size]


def translate(raw: bytes, translator: StreamTranslator, size: int) -> list[dict[str, Any]]:
    import asyncio

    async def collect() -> bytes:
        return b"".join([piece async for piece in translate_stream(_pieces(raw, size), translator)])

    out = asyncio.run(collect())
    events = []
    for event in SSEParser().feed(out):
        assert event.data is not None
        obj = orjson.loads(event.data)
        name = event.raw.split(b"\n", 1)[0]
        assert name == b"event: " + obj["type"].encode()  # the event line names the type
        events.append(obj)
    return events


def _chunk_text(raw: bytes) -> str:
    text = []
    for event in SSEParser().feed(raw):
        if event.data and event.data != b"[DONE]":
            for choice in orjson.loads(event.data).get("choices") or ():
                text.append(choice["delta"].get("content") or "")
    return "".join(text)


@pytest.mark.parametrize("size", [1, 7, 4096])
def test_a_recorded_vllm_stream_as_messages_events(size: int) -> None:
    raw = recorded("chat_stream.sse")
    events = translate(raw, MessagesStream(MessagesCall("tiny-qwen3", True, ())), size)
    for event in events:
        ANTHROPIC_EVENT.validate_python(event)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0]["message"]["usage"]["input_tokens"] == 10  # the prompt's token ids
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == _chunk_text(raw)
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    assert events[-2]["usage"] == {"output_tokens": 4, "input_tokens": 10}


@pytest.mark.parametrize("size", [1, 7, 4096])
def test_a_recorded_vllm_stream_as_responses_events(size: int) -> None:
    raw = recorded("chat_stream.sse")
    stored: list[dict[str, Any]] = []
    call = ResponsesCall("resp_1", "tiny-qwen3", True, None, [])
    events = translate(raw, ResponsesStream(call, stored.append), size)
    for event in events:
        check_responses_event(event)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == 4
    assert final["output"][0]["content"][0]["text"] == _chunk_text(raw)
    assert stored == [{"role": "assistant", "content": _chunk_text(raw)}]


def test_a_recorded_in_stream_error_ends_each_protocol_in_its_error_event() -> None:
    raw = recorded("chat_error_stream.sse")
    messages = translate(raw, MessagesStream(MessagesCall("m", True, ())), 5)
    assert [e["type"] for e in messages] == ["error"]
    assert messages[0]["error"]["message"] == "Invalid grammar specification: 'triggers'"
    stored: list[dict[str, Any]] = []
    responses = translate(
        raw, ResponsesStream(ResponsesCall("r", "m", True, None, []), stored.append), 5
    )
    for event in responses:
        check_responses_event(event)
    assert [e["type"] for e in responses][-2:] == ["error", "response.failed"]
    assert responses[-1]["response"]["status"] == "failed" and stored == []
