"""A chat stream, chunk by chunk, as Anthropic Messages stream events.

`message_start` goes out with the chat stream's first chunk (its input token count from
the prompt's token ids), then one content block per run of reasoning (`thinking`, with
`thinking_delta` and a closing `signature_delta`), text (`text_delta`) or tool call
(`tool_use`, with `input_json_delta`), each opened by `content_block_start` and closed by
`content_block_stop`; the usage chunk (or `[DONE]`) brings `message_delta` with the stop
reason and output tokens, and `[DONE]` `message_stop`. A failure part-way is an `error`
event, after which nothing more is sent.
"""

from __future__ import annotations

import uuid
from typing import Any

from turnstile.protocols.common import (
    first_choice,
    reasoning_of,
    sse_event,
    text_or_none,
    tool_call_deltas,
    tool_call_fragment,
    usage_counts,
)
from turnstile.protocols.messages import MessagesCall, error_event, message_id, stop_reason


class MessagesStream:
    """The `StreamTranslator` of `/v1/messages`."""

    def __init__(self, call: MessagesCall) -> None:
        self.call = call
        self.started = False
        self.block: str | None = None  # the open block's type
        self.index = -1  # the open (or last) block's index
        self.tool_ids: dict[int, str] = {}  # chat tool-call index -> its tool_use id
        self.tool_index: int | None = None  # the chat index of the open tool_use block
        self.tool_used = False
        self.finish_reason: str | None = None
        self.matched: Any = None
        self.input_tokens: int | None = None  # from the usage chunk
        self.output_tokens = 0
        self.delta_sent = False

    def start(self) -> bytes:
        return b""

    def _message_start(self, obj: dict[str, Any]) -> bytes:
        self.started = True
        prompt = obj.get("prompt_token_ids")
        input_tokens = len(prompt) if isinstance(prompt, list) else 0
        message: dict[str, Any] = {
            "id": message_id(obj.get("id")),
            "type": "message",
            "role": "assistant",
            "model": self.call.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        }
        return sse_event("message_start", {"type": "message_start", "message": message})

    def _close(self) -> bytes:
        if self.block is None:
            return b""
        out = b""
        if self.block == "thinking":
            delta = {"type": "signature_delta", "signature": uuid.uuid4().hex}
            out += self._delta(delta)
        out += sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        self.block, self.tool_index = None, None
        return out

    def _open(self, block: dict[str, Any]) -> bytes:
        out = self._close()
        self.index += 1
        self.block = block["type"]
        event = {"type": "content_block_start", "index": self.index, "content_block": block}
        return out + sse_event("content_block_start", event)

    def _delta(self, delta: dict[str, Any]) -> bytes:
        event = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return sse_event("content_block_delta", event)

    def chunk(self, obj: dict[str, Any]) -> bytes:
        out = b"" if self.started else self._message_start(obj)
        choice = first_choice(obj)
        if choice is None:
            counts = usage_counts(obj)
            if counts is not None:
                self.input_tokens, self.output_tokens = counts
                out += self._message_delta()
            return out
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self.output_tokens += len(ids)
        if choice.get("finish_reason") is not None:
            self.finish_reason = text_or_none(choice["finish_reason"])
            self.matched = choice.get("stop_reason")
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return out
        reasoning = reasoning_of(delta)
        if reasoning:
            if self.block != "thinking":
                out += self._open({"type": "thinking", "thinking": "", "signature": ""})
            out += self._delta({"type": "thinking_delta", "thinking": reasoning})
        content = text_or_none(delta.get("content"))
        if content:
            if self.block != "text":
                out += self._open({"type": "text", "text": ""})
            out += self._delta({"type": "text_delta", "text": content})
        for call in tool_call_deltas(delta):
            out += self._tool_delta(call)
        return out

    def _tool_delta(self, call: dict[str, Any]) -> bytes:
        out = b""
        index, name, arguments = tool_call_fragment(call)
        if index not in self.tool_ids and (call.get("id") or name):
            self.tool_ids[index] = str(call.get("id") or f"toolu_{uuid.uuid4().hex}")
            block = {"type": "tool_use", "id": self.tool_ids[index], "name": name or ""}
            out += self._open({**block, "input": {}})
            self.tool_index, self.tool_used = index, True
        if arguments and self.tool_index == index:
            out += self._delta({"type": "input_json_delta", "partial_json": arguments})
        return out

    def _message_delta(self) -> bytes:
        if self.delta_sent:
            return b""
        self.delta_sent = True
        out = self._close()
        reason, sequence = stop_reason(self.finish_reason, self.matched, self.tool_used)
        usage = {"output_tokens": self.output_tokens}
        if self.input_tokens is not None:  # cumulative, as Anthropic's message_delta has it
            usage["input_tokens"] = self.input_tokens
        event = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage,
        }
        return out + sse_event("message_delta", event)

    def done(self) -> bytes:
        out = b"" if self.started else self._message_start({})
        out += self._message_delta()
        return out + sse_event("message_stop", {"type": "message_stop"})

    def error(self, message: str) -> bytes:
        return sse_event("error", error_event(message))
