"""Record mode's --preserve-tool-arguments: tool-call arguments as the model sampled them."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

from turnstile.backends.fake import (
    JSON_HEADERS,
    FakeResponse,
    chat_choice,
    chat_completion,
    usage,
)
from turnstile.backends.fake import chat_message as fake_message
from turnstile.proxy.tool_arguments import (
    PreserveToolArguments,
    preserve_arguments,
    sampled_objects,
)
from turnstile.settings import SettingsError, load_settings

# What a model wrote: compact JSON, two calls, non-ASCII kept.
SAMPLED = (
    '<tool_call>\n{"name":"get_weather","arguments":{"city":"Zürich","days":2}}\n</tool_call>'
    '<tool_call>\n{"name":"get_time","arguments":{"timezone":"Europe/Zurich"}}\n</tool_call>'
)
# What vLLM's hermes parser answers: the arguments re-serialised with json.dumps.
PARSED = [
    {
        "id": "call_a",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "days": 2}'},
    },
    {
        "id": "call_b",
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"timezone": "Europe/Zurich"}'},
    },
]


def _message() -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": orjson.loads(orjson.dumps(PARSED))}


def test_sampled_objects_finds_nested_objects_as_written() -> None:
    found = [raw for raw, _ in sampled_objects('x {"a":{"b": 1}} y {bad {"c":2}')]
    assert found == ['{"a":{"b": 1}}', '{"b": 1}', '{"c":2}']


def test_arguments_are_replaced_by_the_sampled_text() -> None:
    message = _message()
    assert preserve_arguments(message, SAMPLED) == 2
    arguments = [call["function"]["arguments"] for call in message["tool_calls"]]
    assert arguments == ['{"city":"Zürich","days":2}', '{"timezone":"Europe/Zurich"}']


def test_arguments_not_found_in_the_sample_are_kept() -> None:
    message = _message()
    other = '<tool_call>{"name":"get_weather","arguments":{"city":"Bern"}}</tool_call>'
    assert preserve_arguments(message, other) == 0
    assert message["tool_calls"] == PARSED
    # Already as sampled: nothing to replace.
    assert preserve_arguments({"tool_calls": PARSED}, '{"city": "Zürich", "days": 2}') == 0


class _Tokenizer:
    """Decodes the token ids of the fake answer to the sampled text."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        assert list(ids) == [7, 8, 9] and not skip_special_tokens
        return SAMPLED


class _Backend:
    base_url = "http://fake"

    def __init__(self, body: bytes) -> None:
        self.body = body

    async def request(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> FakeResponse:
        return FakeResponse(200, JSON_HEADERS, [self.body])

    async def aclose(self) -> None:
        return None


def _answer() -> bytes:
    choice = chat_choice(0, fake_message("", PARSED), None, "tool_calls", [7, 8, 9])
    return orjson.dumps(chat_completion("chatcmpl-1", "m", [choice], usage(3, 3), [1, 2, 3]))


def test_the_wrapper_rewrites_whole_answers_and_relays_streams() -> None:
    wrapper = PreserveToolArguments(_Backend(_answer()), _Tokenizer())

    async def call(stream: bool) -> bytes:
        body = orjson.dumps({"model": "m", "messages": [], "stream": stream})
        resp = await wrapper.request("POST", "/v1/chat/completions", body, {})
        try:
            return await resp.read()
        finally:
            resp.close()

    whole = orjson.loads(asyncio.run(call(False)))
    calls = whole["choices"][0]["message"]["tool_calls"]
    assert calls[0]["function"]["arguments"] == '{"city":"Zürich","days":2}'
    assert calls[1]["function"]["arguments"] == '{"timezone":"Europe/Zurich"}'
    assert wrapper.stats()["tool_arguments_preserved"] == 2
    # A streamed answer is relayed as the backend wrote it.
    assert asyncio.run(call(True)) == _answer()


def test_the_setting_needs_record_mode_and_a_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="preserve_tool_arguments"):
        load_settings(None, {"preserve_tool_arguments": True}, environ={})
    with pytest.raises(SettingsError, match="preserve_tool_arguments"):
        load_settings(
            None,
            {"preserve_tool_arguments": True, "mode": "tito", "tokenizer": tmp_path},
            environ={},
        )
    settings = load_settings(
        None, {"preserve_tool_arguments": True, "tokenizer": tmp_path}, environ={}
    )
    assert settings.preserve_tool_arguments
