"""The conversations the template audit renders, each message tagged with its kind.

A *kind* is what the audit reports on: one way a message can look (a system prompt, an
assistant turn with reasoning in ``reasoning_content``, parallel tool calls with JSON-string
arguments, a tool result, ...). Every kind appears in at least one conversation that ends
with a user or tool message, so its rendering is checked both as the newest turn and as
history. Conversations without a system message or tool role exist so that templates which
reject those still get their other kinds checked.

The texts are short but distinct, so a break's context shows which message it is in; the
tool arguments include a non-ASCII value, so a template that escapes it is caught.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ASSISTANT_KINDS",
    "KIND_ORDER",
    "REASONING_KINDS",
    "Conversation",
    "battery",
]

KIND_SYSTEM = "system"
KIND_USER = "user"
KIND_TOOL = "tool"
KIND_ASSISTANT = "assistant"
KIND_REASONING_CONTENT = "assistant.reasoning_content"
KIND_REASONING = "assistant.reasoning"
KIND_THINK_IN_CONTENT = "assistant.think_in_content"
KIND_TOOL_CALL = "assistant.tool_call"
KIND_PARALLEL_DICT = "assistant.parallel_tool_calls.dict_args"
KIND_PARALLEL_JSON = "assistant.parallel_tool_calls.json_args"
KIND_REASONING_TOOL_CALL = "assistant.reasoning_tool_call"

KIND_ORDER: tuple[str, ...] = (
    KIND_SYSTEM,
    KIND_USER,
    KIND_ASSISTANT,
    KIND_REASONING_CONTENT,
    KIND_REASONING,
    KIND_THINK_IN_CONTENT,
    KIND_TOOL_CALL,
    KIND_PARALLEL_DICT,
    KIND_PARALLEL_JSON,
    KIND_REASONING_TOOL_CALL,
    KIND_TOOL,
)
ASSISTANT_KINDS = frozenset(kind for kind in KIND_ORDER if kind.startswith("assistant"))
# Kinds whose assistant message carries reasoning, and in which field the template must
# find it ("content" for <think> inside the content).
REASONING_KINDS: dict[str, str] = {
    KIND_REASONING_CONTENT: "reasoning_content",
    KIND_REASONING: "reasoning",
    KIND_THINK_IN_CONTENT: "content",
    KIND_REASONING_TOOL_CALL: "reasoning_content",
}

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "days": {"type": "integer", "description": "Days ahead"},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a time zone.",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string", "description": "IANA zone"}},
                "required": ["timezone"],
            },
        },
    },
]
# Mistral-family templates require tool call ids of exactly nine alphanumerics.
_CALL_IDS = ("call0wthr", "call1time", "call2wthr", "call3time")


@dataclass(frozen=True)
class Message:
    """One message of a conversation, with its kind and the texts a faithful rendering of
    it must contain (what the model sampled for an assistant turn). ``json_arguments``: tool
    call arguments sent as JSON strings, which a template given them as strings must render
    as sent."""

    kind: str
    body: dict[str, Any]
    expect: tuple[str, ...] = ()
    reasoning: str | None = None
    json_arguments: tuple[str, ...] = ()


@dataclass(frozen=True)
class Conversation:
    name: str
    messages: tuple[Message, ...]
    tools: list[dict[str, Any]] | None = None

    def bodies(self) -> list[dict[str, Any]]:
        return [copy.deepcopy(message.body) for message in self.messages]


def _system() -> Message:
    return Message(KIND_SYSTEM, {"role": "system", "content": "You are a terse assistant."})


def _user(n: int) -> Message:
    texts = {
        1: "What is the weather in Zürich?",
        2: "And tomorrow?",
        3: "Thanks. One more question.",
    }
    return Message(KIND_USER, {"role": "user", "content": texts[n]})


def _assistant(n: int) -> Message:
    text = f"Answer {n}: it is sunny."
    return Message(KIND_ASSISTANT, {"role": "assistant", "content": text}, (text,))


def _reasoning_text(n: int) -> str:
    return f"Reasoning {n}: the user wants a forecast."


def _reasoning_content(n: int) -> Message:
    text, reasoning = f"Answer {n}: mild.", _reasoning_text(n)
    body = {"role": "assistant", "content": text, "reasoning_content": reasoning}
    return Message(KIND_REASONING_CONTENT, body, (text,), reasoning)


def _reasoning_field(n: int) -> Message:
    text, reasoning = f"Answer {n}: windy.", _reasoning_text(n)
    body = {"role": "assistant", "content": text, "reasoning": reasoning}
    return Message(KIND_REASONING, body, (text,), reasoning)


def _think_in_content(n: int, open_think: bool) -> Message:
    """Reasoning inside the content, as a model's raw output carries it. When the
    generation prompt already opens the <think> block, the output starts inside it."""
    text, reasoning = f"Answer {n}: cloudy.", _reasoning_text(n)
    opening = "" if open_think else "<think>\n"
    body = {"role": "assistant", "content": f"{opening}{reasoning}\n</think>\n\n{text}"}
    return Message(KIND_THINK_IN_CONTENT, body, (text,), reasoning)


def _call(index: int, name: str, arguments: dict[str, Any], as_json: bool) -> dict[str, Any]:
    value: Any = json.dumps(arguments, ensure_ascii=False) if as_json else arguments
    return {
        "id": _CALL_IDS[index],
        "type": "function",
        "function": {"name": name, "arguments": value},
    }


_WEATHER_ARGS = {"city": "Zürich", "days": 2}
_TIME_ARGS = {"timezone": "Europe/Zurich"}


def _tool_calls(kind: str, *, parallel: bool, as_json: bool, first_id: int = 0) -> Message:
    calls = [_call(first_id, "get_weather", _WEATHER_ARGS, as_json)]
    expect = ["get_weather", "Zürich"]
    if parallel:
        calls.append(_call(first_id + 1, "get_time", _TIME_ARGS, as_json))
        expect += ["get_time", "Europe/Zurich"]
    json_arguments = tuple(call["function"]["arguments"] for call in calls) if as_json else ()
    body = {"role": "assistant", "content": "", "tool_calls": calls}
    return Message(kind, body, tuple(expect), json_arguments=json_arguments)


def _reasoning_tool_call(n: int) -> Message:
    reasoning = _reasoning_text(n) + " I should call a tool."
    call = _call(n % len(_CALL_IDS), "get_weather", _WEATHER_ARGS, as_json=False)
    body = {
        "role": "assistant",
        "content": "",
        "reasoning_content": reasoning,
        "tool_calls": [call],
    }
    return Message(KIND_REASONING_TOOL_CALL, body, ("get_weather", "Zürich"), reasoning)


def _tool(index: int, name: str, result: str) -> Message:
    body = {"role": "tool", "tool_call_id": _CALL_IDS[index], "name": name, "content": result}
    return Message(KIND_TOOL, body)


def battery(open_think: bool = False) -> list[Conversation]:
    """The audit's conversations. ``open_think``: the template's generation prompt opens a
    <think> block, so raw model output (the think-in-content kind) starts inside it."""
    weather = '{"temperature_c": 18, "sky": "sunny"}'
    clock = '{"time": "14:05"}'
    return [
        Conversation(
            "system+user", (_system(), _user(1), _assistant(1), _user(2), _assistant(2), _user(3))
        ),
        Conversation("user only", (_user(1), _assistant(1), _user(2), _assistant(2), _user(3))),
        Conversation(
            "reasoning_content",
            (_user(1), _reasoning_content(1), _user(2), _reasoning_content(2), _user(3)),
        ),
        Conversation(
            "reasoning field",
            (_user(1), _reasoning_field(1), _user(2), _reasoning_field(2), _user(3)),
        ),
        Conversation(
            "<think> in content",
            (
                _user(1),
                _think_in_content(1, open_think),
                _user(2),
                _think_in_content(2, open_think),
                _user(3),
            ),
        ),
        Conversation(
            "single tool call",
            (
                _user(1),
                _tool_calls(KIND_TOOL_CALL, parallel=False, as_json=False),
                _tool(0, "get_weather", weather),
                _assistant(1),
                _user(2),
            ),
            TOOLS,
        ),
        Conversation(
            "parallel tool calls, dict arguments",
            (
                _system(),
                _user(1),
                _tool_calls(KIND_PARALLEL_DICT, parallel=True, as_json=False),
                _tool(0, "get_weather", weather),
                _tool(1, "get_time", clock),
                _assistant(1),
                _user(2),
            ),
            TOOLS,
        ),
        Conversation(
            "parallel tool calls, JSON-string arguments",
            (
                _system(),
                _user(1),
                _tool_calls(KIND_PARALLEL_JSON, parallel=True, as_json=True),
                _tool(0, "get_weather", weather),
                _tool(1, "get_time", clock),
                _assistant(1),
                _user(2),
            ),
            TOOLS,
        ),
        Conversation(
            "reasoning tool loop, several rounds",
            (
                _user(1),
                _reasoning_tool_call(1),
                _tool(1, "get_weather", weather),
                _reasoning_tool_call(2),
                _tool(2, "get_weather", weather),
                _reasoning_content(3),
                _user(2),
                _assistant(4),
                _user(3),
            ),
            TOOLS,
        ),
    ]
