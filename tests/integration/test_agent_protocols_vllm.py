"""End to end: the `anthropic` and `openai` SDKs on the Messages and Responses routes ->
Turnstile -> the real CPU vLLM -> Parquet.

Each call, whole or streamed, with tools, must leave an `ok` turn whose prompt ids are
exactly what vLLM's own `/tokenize` makes of the translated conversation and whose
completion ids are what vLLM sampled (the usage the client saw counts the same tokens).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.live import TurnstileServer
from turnstile.reader import open_output

MODEL = "tiny-qwen3"
MAX_TOKENS = 12
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather for a city",
            "parameters": PARAMETERS,
        },
    }
]
ANTHROPIC_TOOLS: Any = [
    {"name": "get_weather", "description": "Get the weather for a city", "input_schema": PARAMETERS}
]
RESPONSES_TOOLS: Any = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Get the weather for a city",
        "parameters": PARAMETERS,
    }
]


@pytest.fixture
def turnstile(
    vllm_server: Any, qwen3_tokenizer_dir: Path, tmp_path: Path
) -> Iterator[TurnstileServer]:
    ts = TurnstileServer(vllm_server.base_url, tmp_path / "out", qwen3_tokenizer_dir)
    ts.start()
    yield ts
    ts.stop()


def vllm_tokenize(base_url: str, messages: list[dict[str, Any]]) -> list[int]:
    body = {
        "model": MODEL,
        "messages": messages,
        "tools": CHAT_TOOLS,
        "add_generation_prompt": True,
    }
    resp = httpx.post(base_url + "/tokenize", json=body, timeout=60)
    resp.raise_for_status()
    return list(resp.json()["tokens"])


def recorded_turns(ts: TurnstileServer, rollout_id: str) -> list[dict[str, Any]]:
    httpx.post(f"{ts.url}/rollouts/{rollout_id}/finish", timeout=30).raise_for_status()
    ts.stop()
    turns = [t for t in open_output(ts.output).turns().to_pylist() if t["rollout_id"] == rollout_id]
    return sorted(turns, key=lambda t: t["turn_index"])


def test_messages_whole_and_streamed_are_recorded_exactly(
    turnstile: TurnstileServer, vllm_server: Any
) -> None:
    rid = httpx.post(turnstile.url + "/rollouts", json={}).json()["rollout_id"]
    # Claude Code's way: ANTHROPIC_BASE_URL=.../rollouts/{id}; the SDK adds /v1/messages.
    client = anthropic.Anthropic(
        base_url=f"{turnstile.url}/rollouts/{rid}", api_key="unused", max_retries=0
    )
    system = "You are a helpful assistant."
    question = "What's the weather in Paris?"
    counted = client.messages.count_tokens(
        model=MODEL,
        system=system,
        messages=[{"role": "user", "content": question}],
        tools=ANTHROPIC_TOOLS,
    )
    first = client.messages.create(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        system=system,
        messages=[{"role": "user", "content": question}],
        tools=ANTHROPIC_TOOLS,
    )
    assert first.stop_reason in ("end_turn", "max_tokens", "tool_use")
    answer = "".join(b.text for b in first.content if b.type == "text")
    history: Any = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer or "ok"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    with client.messages.stream(
        model=MODEL, max_tokens=MAX_TOKENS, system=system, messages=history, tools=ANTHROPIC_TOOLS
    ) as stream:
        streamed_text = "".join(stream.text_stream)
        second = stream.get_final_message()
    turns = recorded_turns(turnstile, rid)
    assert len(turns) == 2
    chat_first = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    chat_second = [{"role": "system", "content": system}, *history]
    for turn, messages, message in ((turns[0], chat_first, first), (turns[1], chat_second, second)):
        assert turn["status"] == "ok" and turn["token_source"] == "backend"
        assert turn["endpoint"] == "chat.completions"
        assert turn["prompt_token_ids"] == vllm_tokenize(vllm_server.base_url, messages)
        assert message.usage.input_tokens == len(turn["prompt_token_ids"])
        assert message.usage.output_tokens == len(turn["completion_token_ids"])
        assert all(lp == lp for lp in turn["behavior_logprobs"])  # no NaN: real logprobs
    assert counted.input_tokens == len(turns[0]["prompt_token_ids"])
    assert streamed_text == "".join(b.text for b in second.content if b.type == "text")


def test_responses_whole_and_streamed_are_recorded_exactly(
    turnstile: TurnstileServer, vllm_server: Any
) -> None:
    created = httpx.post(turnstile.url + "/rollouts", json={}).json()
    rid = created["rollout_id"]
    client = openai.OpenAI(base_url=created["base_url"], api_key="unused", max_retries=0)
    instructions = "You are a helpful assistant."
    first = client.responses.create(
        model=MODEL,
        instructions=instructions,
        input="What's the weather in Paris?",
        tools=RESPONSES_TOOLS,
        max_output_tokens=MAX_TOKENS,
    )
    assert first.status in ("completed", "incomplete")
    with client.responses.stream(
        model=MODEL,
        instructions=instructions,
        input="And tomorrow?",
        previous_response_id=first.id,
        tools=RESPONSES_TOOLS,
        max_output_tokens=MAX_TOKENS,
    ) as stream:
        kinds = [event.type for event in stream]
        second = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert second.status in ("completed", "incomplete")
    turns = recorded_turns(turnstile, rid)
    assert len(turns) == 2
    first_reply: dict[str, Any] = {"role": "assistant", "content": first.output_text or None}
    calls = [item for item in first.output if item.type == "function_call"]
    if calls:
        first_reply["tool_calls"] = [
            {
                "id": c.call_id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls
        ]
    chat_first = [
        {"role": "system", "content": instructions},
        {"role": "user", "content": "What's the weather in Paris?"},
    ]
    chat_second = [*chat_first, first_reply, {"role": "user", "content": "And tomorrow?"}]
    for turn, messages, response in (
        (turns[0], chat_first, first),
        (turns[1], chat_second, second),
    ):
        assert turn["status"] == "ok" and turn["token_source"] == "backend"
        assert turn["prompt_token_ids"] == vllm_tokenize(vllm_server.base_url, messages)
        assert response.usage is not None
        assert response.usage.input_tokens == len(turn["prompt_token_ids"])
        assert response.usage.output_tokens == len(turn["completion_token_ids"])
