"""A chat stream, chunk by chunk, as OpenAI Responses stream events.

`response.created` and `response.in_progress` go out at once; then one output item per
run of reasoning (`reasoning_text` deltas), text (`output_text` deltas, inside a
`message` item and its `output_text` part) or tool call (`function_call_arguments`
deltas), each opened by `response.output_item.added` and closed by its `.done` events and
`response.output_item.done`; `[DONE]` brings `response.completed` with the whole
response, whose status is `incomplete` when the answer was cut at `max_output_tokens` (as
vLLM's own `/v1/responses` sends it: clients such as Codex treat a `response.incomplete`
event as a failed call, and the SDKs' final-response helpers wait for `completed`).
Every event carries its `sequence_number`. A failure part-way is an `error` event and
`response.failed`, after which nothing more is sent. `on_complete` is called
with the answer as a chat message before `response.completed` goes out, so the
conversation is stored before the client can name it as `previous_response_id`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from turnstile.protocols import responses as r
from turnstile.protocols.common import (
    first_choice,
    reasoning_of,
    sse_event,
    text_or_none,
    tool_call_deltas,
    tool_call_fragment,
    usage_counts,
)


class ResponsesStream:
    """The `StreamTranslator` of `/v1/responses`."""

    def __init__(
        self, call: r.ResponsesCall, on_complete: Callable[[dict[str, Any]], None]
    ) -> None:
        self.call = call
        self.on_complete = on_complete
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.kind: str | None = None  # the open item's type
        self.item: dict[str, Any] = {}
        self.text: list[str] = []  # the open item's text or arguments
        self.tool_index: int | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # chat index -> the chat tool call
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.usage: tuple[int, int] | None = None
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.finish_reason: str | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(kind, event)

    def start(self) -> bytes:
        created = r.response_object(self.call, "in_progress", [], None)
        return self._event("response.created", response=created) + self._event(
            "response.in_progress", response=created
        )

    # -- items ------------------------------------------------------------------------
    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item["id"], "output_index": len(self.output)}

    def _open(self, kind: str, item: dict[str, Any]) -> bytes:
        out = self._close()
        self.kind, self.item, self.text = kind, item, []
        out += self._event("response.output_item.added", output_index=len(self.output), item=item)
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._event(
                "response.content_part.added", **self._where(), content_index=0, part=part
            )
        elif kind == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
            out += self._event(
                "response.content_part.added", **self._where(), content_index=0, part=part
            )
        return out

    def _close(self) -> bytes:
        if self.kind is None:
            return b""
        text, where, out = "".join(self.text), self._where(), b""
        if self.kind == "message":
            item = r.message_item(self.item["id"], text, "completed")
            out += self._event(
                "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
            )
            part = item["content"][0]
            out += self._event("response.content_part.done", **where, content_index=0, part=part)
        elif self.kind == "reasoning":
            item = r.reasoning_item(self.item["id"], text, "completed")
            out += self._event("response.reasoning_text.done", **where, content_index=0, text=text)
            part = item["content"][0]
            out += self._event("response.content_part.done", **where, content_index=0, part=part)
        else:
            item = {**self.item, "arguments": text, "status": "completed"}
            out += self._event(
                "response.function_call_arguments.done", **where, name=item["name"], arguments=text
            )
        out += self._event("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)
        self.kind, self.item, self.tool_index = None, {}, None
        return out

    # -- chunks -----------------------------------------------------------------------
    def chunk(self, obj: dict[str, Any]) -> bytes:
        prompt = obj.get("prompt_token_ids")
        if isinstance(prompt, list):
            self.prompt_tokens = len(prompt)
        choice = first_choice(obj)
        if choice is None:
            self.usage = usage_counts(obj) or self.usage
            return b""
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self.output_tokens += len(ids)
        if choice.get("finish_reason") is not None:
            self.finish_reason = text_or_none(choice["finish_reason"])
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return b""
        out = b""
        reasoning = reasoning_of(delta)
        if reasoning:
            if self.kind != "reasoning":
                out += self._open(
                    "reasoning",
                    {
                        "id": r.item_id("rs"),
                        "type": "reasoning",
                        "summary": [],
                        "status": "in_progress",
                    },
                )
            self.text.append(reasoning)
            self.reasoning.append(reasoning)
            out += self._event(
                "response.reasoning_text.delta", **self._where(), content_index=0, delta=reasoning
            )
        content = text_or_none(delta.get("content"))
        if content:
            if self.kind != "message":
                out += self._open(
                    "message",
                    {**r.message_item(r.item_id("msg"), "", "in_progress"), "content": []},
                )
            self.text.append(content)
            self.content.append(content)
            out += self._event(
                "response.output_text.delta",
                **self._where(),
                content_index=0,
                delta=content,
                logprobs=[],
            )
        for call in tool_call_deltas(delta):
            out += self._tool_delta(call)
        return out

    def _tool_delta(self, call: dict[str, Any]) -> bytes:
        out = b""
        index, name, arguments = tool_call_fragment(call)
        if index not in self.calls and (call.get("id") or name):
            call_id = str(call.get("id") or r.item_id("call"))
            function = {"name": name or "", "arguments": ""}
            self.calls[index] = {"id": call_id, "type": "function", "function": function}
            names = self.call.call_name(name or "")
            item = r.function_call_item(r.item_id("fc"), call_id, names, "", "in_progress")
            out += self._open("function_call", item)
            self.tool_index = index
        if arguments and index in self.calls:
            self.calls[index]["function"]["arguments"] += arguments
            if self.tool_index == index:
                self.text.append(arguments)
                out += self._event(
                    "response.function_call_arguments.delta", **self._where(), delta=arguments
                )
        return out

    def done(self) -> bytes:
        out = self._close()
        counts = self.usage or (self.prompt_tokens, self.output_tokens)
        incomplete = self.finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        body = r.response_object(
            self.call, status, self.output, r.usage_object(*counts), incomplete=incomplete
        )
        calls = [self.calls[k] for k in sorted(self.calls)]
        message = r.assistant_message("".join(self.content), "".join(self.reasoning), calls)
        self.on_complete(message)
        return out + self._event("response.completed", response=body)

    def error(self, message: str) -> bytes:
        out = self._event("error", code="server_error", message=message, param=None)
        error = {"code": "server_error", "message": message}
        body = r.response_object(self.call, "failed", self.output, None, error=error)
        return out + self._event("response.failed", response=body)
