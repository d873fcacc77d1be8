"""A rollout's token state in TITO mode, and whether a new request extends it.

After each successful turn Turnstile keeps a `TurnState`: the request's messages, the
assistant message it returned, and the exact prompt and completion token IDs. A new
request *extends* a state when its messages are that state's messages, unchanged, then an
assistant message that is the one Turnstile returned, then new messages. Comparison is on
meaning, not bytes: tool-call arguments compare as parsed JSON (a harness may re-serialise
them), tool-call ids are not compared, `None` and `""` content are the same, and a
reasoning field the harness left out of the returned message is fine (the sampled tokens
keep the reasoning); a reasoning field that is present must match.

Anything else (compaction, an edited tool argument, a dropped or changed message, other
tools or template options) is a *history rewrite*. `match` also finds a request that
repeats an earlier state's messages exactly (a retry or a branch), and, for the error
message, where the closest state and the request part ways.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from turnstile.records import Int32Array

__all__ = ["Match", "TurnState", "match", "same_message", "same_reply"]


@dataclass(frozen=True, slots=True)
class TurnState:
    """What one successful TITO turn leaves behind for the next."""

    messages: tuple[dict[str, Any], ...]
    reply: dict[str, Any]  # the assistant message returned to the harness
    tools_key: bytes  # canonical JSON of the request's tools
    kwargs_key: bytes  # canonical JSON of the request's chat_template_kwargs
    prompt_ids: Int32Array
    completion_ids: Int32Array
    finish_reason: str | None
    # whether the prompt equals the template's rendering of `messages` (as far as the
    # renderings show): True for a first turn or new segment, carried along extensions
    prompt_faithful: bool = True

    @property
    def context_len(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def context(self) -> Int32Array:
        return np.concatenate([self.prompt_ids, self.completion_ids]).astype(np.int32)


@dataclass(frozen=True, slots=True)
class Match:
    """How a request relates to a rollout's states.

    ``kind``: ``first`` (no state yet), ``extend`` (``state`` + new messages), ``repeat``
    (the same messages as ``state``: re-sample from its prompt) or ``rewrite``.
    ``detail`` says where a rewrite parts from the closest state.
    """

    kind: str
    state: TurnState | None = None
    detail: str = ""


def canonical(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def _text(content: Any) -> Any:
    """Content as compared: `None` and "" alike, text parts joined."""
    if content is None or content == "":
        return ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in content
    ):
        return "".join(str(p.get("text", "")) for p in content)
    return content


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return orjson.loads(value or "{}")
        except orjson.JSONDecodeError:
            return value
    return value


def _calls(calls: Any) -> list[tuple[Any, Any]]:
    out = []
    for call in calls or ():
        function = (call or {}).get("function") or {} if isinstance(call, dict) else {}
        out.append((function.get("name"), _arguments(function.get("arguments"))))
    return out


def _reasoning(message: Mapping[str, Any]) -> Any:
    value = message.get("reasoning")
    return message.get("reasoning_content") if value is None else value


def _normal(message: Mapping[str, Any]) -> bytes:
    fields = {k: v for k, v in message.items() if k not in ("content", "tool_calls")}
    fields["content"] = _text(message.get("content"))
    fields["tool_calls"] = _calls(message.get("tool_calls"))
    if "reasoning_content" in fields and "reasoning" not in fields:
        fields["reasoning"] = fields.pop("reasoning_content")
    fields.pop("reasoning_content", None)
    return canonical(fields)


def same_message(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Two request messages mean the same (see the module docstring)."""
    return a is b or _normal(a) == _normal(b)


def same_reply(sent: Mapping[str, Any], reply: Mapping[str, Any]) -> str | None:
    """None when the harness sent back `reply` unchanged; otherwise what differs."""
    if sent.get("role") != "assistant":
        return f"expected the assistant message returned last turn, got role {sent.get('role')!r}"
    if _text(sent.get("content")) != _text(reply.get("content")):
        return "the assistant message's content differs from what was returned"
    if _calls(sent.get("tool_calls")) != _calls(reply.get("tool_calls")):
        return "the assistant message's tool calls differ from what were returned"
    sent_reasoning = _reasoning(sent)
    if sent_reasoning is not None and (sent_reasoning or "") != (_reasoning(reply) or ""):
        return "the assistant message's reasoning differs from what was returned"
    return None


def _parting(state: TurnState, messages: Sequence[Mapping[str, Any]]) -> tuple[int, str]:
    """How far `messages` follow `state`, and why they stop."""
    for i, old in enumerate(state.messages):
        if i >= len(messages):
            return i, f"message {i} ({old.get('role')}) was dropped"
        if not same_message(old, messages[i]):
            return i, f"message {i} ({old.get('role')}) was changed"
    n = len(state.messages)
    if len(messages) == n:
        return n, "same messages"
    why = same_reply(messages[n], state.reply)
    return n + (why is None), (f"message {n}: {why}" if why else "extends the previous turn")


def match(
    states: Sequence[TurnState],
    messages: Sequence[Mapping[str, Any]],
    tools_key: bytes,
    kwargs_key: bytes,
) -> Match:
    """The longest state `messages` extend, else an exact repeat, else a rewrite."""
    if not states:
        return Match("first")
    best: TurnState | None = None
    repeat: TurnState | None = None
    closest: tuple[int, str, TurnState] | None = None
    for state in states:
        if state.tools_key != tools_key or state.kwargs_key != kwargs_key:
            continue
        depth, why = _parting(state, messages)
        n = len(state.messages)
        if depth == n + 1 and len(messages) > n + 1:
            if best is None or len(state.messages) > len(best.messages):
                best = state
        elif depth == n and len(messages) == n:
            repeat = repeat or state
        if closest is None or depth > closest[0]:
            closest = (depth, why, state)
    if best is not None:
        return Match("extend", best)
    if repeat is not None:
        return Match("repeat", repeat)
    if closest is None:
        return Match("rewrite", None, "the request's tools or chat_template_kwargs changed")
    depth, why, state = closest
    if depth == len(state.messages) + 1:
        why = "the returned assistant message is last: there are no new messages after it"
    return Match("rewrite", state, why)
