"""The OpenAI Agents SDK on its default model (Responses), with a function tool, through
Turnstile: the agent's loop runs to its answer and each model call is one recorded turn."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import agents
import pytest
from fastapi import FastAPI
from openai import AsyncOpenAI

from tests.fakes_backend import Reply
from tests.live import LiveServer
from tests.unit.conftest import MakeApp
from turnstile.records import TurnStatus

MODEL = "fake-model"
CALL = {"id": "call_7", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}


@agents.function_tool
def add(a: int) -> int:
    """Adds one to a."""
    return a + 1


def _script(body: dict[str, Any]) -> Reply:
    if any(m["role"] == "tool" for m in body["messages"]):
        return Reply(text="two")
    return Reply(text="", tool_calls=[CALL], finish_reason="tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_runs_its_tool_loop_through_turnstile(
    make_app: MakeApp, live: Callable[[FastAPI], LiveServer], stream: bool
) -> None:
    h = make_app(_script)
    server = live(h.app)
    agents.set_tracing_disabled(True)

    async def run() -> Any:
        client = AsyncOpenAI(
            base_url=f"{server.url}/rollouts/agent-1/v1", api_key="k", max_retries=0
        )
        model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
        agent = agents.Agent(name="calc", instructions="Use the tool.", model=model, tools=[add])
        try:
            if not stream:
                return await agents.Runner.run(agent, "add one to 1")
            result = agents.Runner.run_streamed(agent, "add one to 1")
            async for _ in result.stream_events():
                pass
            return result
        finally:
            await client.close()

    result = asyncio.run(run())
    assert result.final_output == "two"
    server.stop()
    turns = sorted(h.sink.turns, key=lambda t: t.turn_index)
    assert [t.rollout_id for t in turns] == ["agent-1", "agent-1"]
    assert all(t.status is TurnStatus.OK for t in turns)
    second = json.loads(turns[1].request_messages_json or "")
    assert second[0] == {"role": "system", "content": "Use the tool."}
    assert second[-1] == {"role": "tool", "tool_call_id": "call_7", "content": "2"}
    tools = json.loads(turns[0].request_tools_json or "")
    assert tools[0]["function"]["name"] == "add"
