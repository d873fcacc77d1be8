"""Anthropic Messages <-> Chat Completions, for `POST /v1/messages` and its token count.

`to_chat` turns a Messages request into the chat request Turnstile forwards (and records):
the system blocks become one leading system message (Claude Code's per-request
`x-anthropic-billing-header` block is dropped, as vLLM's own Messages route does, since
its hash would change every prompt), text blocks become content, `thinking` becomes the
assistant message's `reasoning`, `redacted_thinking` (opaque) is dropped, `tool_use`
becomes `tool_calls` and each `tool_result` a `tool` message. The mapping follows vLLM
0.32's `/v1/messages` so a prompt renders as it would there. An assistant message last
asks the backend to continue it (Anthropic's prefill). Several text blocks of one message
are joined with newlines, as vLLM joins text parts before a chat template renders them
(and as TITO's own rendering needs: templates take string content).

Images: an `image` block in a user message or in a `tool_result`'s content becomes a chat
`image_url` part (a `base64` source as a `data:<media_type>;base64,<data>` URL, a `url`
source as its URL), and that message's content is then a list of `text` and `image_url`
parts in the order given, as vLLM takes them for user and tool messages (and as
`turnstile.proxy.media` records them). A `file` source is refused with 422 (Turnstile has
no Files API), and so are images in assistant or system messages and `document` blocks.

`from_chat` turns the chat answer into a Messages answer (`thinking`, `text` and
`tool_use` blocks, `stop_reason` as vLLM maps it), and `error_body` writes any error in
Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any, Final

import orjson

from turnstile.errors import BadRequest, TurnstileError, Unprocessable
from turnstile.images import IMAGE_MIME_TYPES
from turnstile.protocols import checks
from turnstile.protocols.common import (
    chat_content,
    first_choice,
    reasoning_of,
    text_or_none,
    usage_counts,
)

log = logging.getLogger("turnstile.protocols.messages")

# Claude Code's first system block: a per-request hash that would make every prompt new.
BILLING_HEADER: Final[str] = "x-anthropic-billing-header"
_SAMPLING: Final[dict[str, str]] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
}
# Anthropic's error type for each status (anything else 4xx: invalid_request_error; 5xx:
# api_error).
_ERROR_TYPES: Final[dict[int, str]] = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_TOOL_CHOICES: Final[dict[str, str]] = {"auto": "auto", "any": "required", "none": "none"}
# An image block's base64 data (standard alphabet, padded or not).
_BASE64: Final[re.Pattern[str]] = re.compile(r"[A-Za-z0-9+/]+={0,2}")


@dataclass(frozen=True, slots=True)
class MessagesCall:
    """What the answer needs from the request."""

    model: str
    stream: bool
    stop_sequences: tuple[str, ...]


def to_chat(body: Any, *, count_only: bool = False) -> tuple[dict[str, Any], MessagesCall]:
    """The chat request for a Messages request (400/422 for one that cannot be served)."""
    body = checks.obj(body, "body")
    model = checks.text(body.get("model"), "model")
    messages: list[dict[str, Any]] = []
    system = _system_text(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    raw = checks.array(body.get("messages"), "messages")
    if not raw:
        raise BadRequest("messages must not be empty", param="messages")
    for i, message in enumerate(raw):
        _add_message(checks.obj(message, f"messages[{i}]"), i, messages)
    chat: dict[str, Any] = {"model": model, "messages": messages}
    _add_tools(body, chat)
    if isinstance(body.get("chat_template_kwargs"), dict):
        chat["chat_template_kwargs"] = dict(body["chat_template_kwargs"])
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        chat.setdefault("chat_template_kwargs", {}).setdefault("enable_thinking", False)
    stops = checks.array(body.get("stop_sequences") or [], "stop_sequences")
    stop_sequences = tuple(checks.text(s, "stop_sequences") for s in stops)
    stream = False
    if not count_only:
        chat["max_tokens"] = checks.positive_int(body.get("max_tokens"), "max_tokens")
        checks.copy_numbers(body, chat, _SAMPLING)
        if stop_sequences:
            chat["stop"] = list(stop_sequences)
        stream = checks.boolean(body.get("stream", False), "stream")
        if stream:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        # The prompt's token ids come back in the first chunk: its input token count.
        chat["return_token_ids"] = True
        if messages[-1]["role"] == "assistant":  # prefill: continue the assistant's text
            chat["continue_final_message"] = True
            chat["add_generation_prompt"] = False
    return chat, MessagesCall(model, stream, stop_sequences)


def _system_text(system: Any) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    parts: list[str] = []
    for i, block in enumerate(checks.array(system, "system")):
        block = checks.obj(block, f"system[{i}]")
        if block.get("type") != "text":
            raise Unprocessable(f"system[{i}]: only text blocks are supported", param="system")
        text = checks.text(block.get("text"), f"system[{i}].text")
        if text and not text.startswith(BILLING_HEADER):
            parts.append(text)
    return "".join(parts)


def _add_message(message: dict[str, Any], i: int, out: list[dict[str, Any]]) -> None:
    role = message.get("role")
    where = f"messages[{i}]"
    if role not in ("user", "assistant", "system"):
        raise BadRequest(f"{where}.role must be 'user' or 'assistant'", param="messages")
    content = message.get("content")
    if isinstance(content, str):
        if role != "system" or content:
            out.append({"role": role, "content": content})
        return
    parts: list[dict[str, Any]] = []  # text and image_url parts, in order
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(checks.array(content, f"{where}.content")):
        block = checks.obj(block, f"{where}.content[{j}]")
        kind = block.get("type")
        at = f"{where}.content[{j}]"
        if kind == "text":
            text = checks.text(block.get("text"), f"{at}.text")
            if text and not (role == "system" and text.startswith(BILLING_HEADER)):
                parts.append({"type": "text", "text": text})
        elif kind == "image" and role == "user":
            parts.append(_image_part(block, at))
        elif kind == "image":
            raise Unprocessable(
                f"{at}: image blocks are supported in user messages and tool results only",
                param="messages",
            )
        elif kind == "document":
            raise Unprocessable(f"{at}: document blocks are not supported yet", param="messages")
        elif kind == "thinking" and role == "assistant":
            reasoning.append(checks.text(block.get("thinking"), f"{at}.thinking"))
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # opaque to any template: the model's own tokens are in the record
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, at))
        elif kind == "tool_result" and role == "user":
            out.append(_tool_message(block, at))
        else:
            raise Unprocessable(f"{at}: a {kind!r:.40} block in a {role} message is not supported")
    chat: dict[str, Any] = {"role": role}
    if parts:
        chat["content"] = chat_content(parts)
    if reasoning:
        chat["reasoning"] = "".join(reasoning)
    if calls:
        chat["tool_calls"] = calls
    if role == "assistant" or parts:
        out.append(chat)


def _image_part(block: dict[str, Any], at: str) -> dict[str, Any]:
    """An `image` block as a chat `image_url` part."""
    source = checks.obj(block.get("source"), f"{at}.source")
    kind = source.get("type")
    if kind == "base64":
        media_type = source.get("media_type")
        if not isinstance(media_type, str) or media_type not in IMAGE_MIME_TYPES:
            raise BadRequest(
                f"{at}.source.media_type must be one of {', '.join(sorted(IMAGE_MIME_TYPES))}",
                param=f"{at}.source.media_type",
            )
        data = source.get("data")
        if not isinstance(data, str) or not _BASE64.fullmatch(data):
            raise BadRequest(
                f"{at}.source.data must be the image's bytes as a non-empty base64 string",
                param=f"{at}.source.data",
            )
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    if kind == "url":
        url = source.get("url")
        scheme, colon, _ = url.partition(":") if isinstance(url, str) else ("", "", "")
        if not colon or scheme.lower() not in ("http", "https"):
            raise BadRequest(f"{at}.source.url must be an http(s) URL", param=f"{at}.source.url")
        return {"type": "image_url", "image_url": {"url": url}}
    if kind == "file":
        raise Unprocessable(
            f"{at}.source: images by file id are not supported (Turnstile has no Files API); "
            "send the image inline (a base64 source) or by URL (a url source)",
            param=f"{at}.source",
        )
    raise BadRequest(
        f"{at}.source.type {kind!r:.40} is not known (base64, url or file)",
        param=f"{at}.source.type",
    )


def _tool_call(block: dict[str, Any], at: str) -> dict[str, Any]:
    call_id = checks.text(block.get("id"), f"{at}.id")
    name = checks.text(block.get("name"), f"{at}.name")
    arguments = checks.obj(block.get("input", {}), f"{at}.input")
    # json.dumps' separators and escapes, as vLLM's own /v1/messages writes them.
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def _tool_message(block: dict[str, Any], at: str) -> dict[str, Any]:
    """A `tool_result` as a tool message: its text as one string, or with images, a list
    of `text` and `image_url` parts in order."""
    call_id = checks.text(block.get("tool_use_id"), f"{at}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, str):
        return {"role": "tool", "tool_call_id": call_id, "content": content}
    parts: list[dict[str, Any]] = []
    for k, part in enumerate(checks.array(content, f"{at}.content")):
        where = f"{at}.content[{k}]"
        part = checks.obj(part, where)
        kind = part.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": checks.text(part.get("text"), f"{where}.text")})
        elif kind == "image":
            parts.append(_image_part(part, where))
        else:
            raise Unprocessable(
                f"{where}: only text and images are supported in a tool_result",
                param="messages",
            )
    return {"role": "tool", "tool_call_id": call_id, "content": chat_content(parts)}


def _add_tools(body: dict[str, Any], chat: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools is not None:
        out = []
        for i, tool in enumerate(checks.array(tools, "tools")):
            tool = checks.obj(tool, f"tools[{i}]")
            if tool.get("type") not in (None, "custom"):
                raise Unprocessable(
                    f"tools[{i}]: server tool {tool.get('type')!r:.60} is not supported; "
                    "give tools with an input_schema",
                    param="tools",
                )
            function: dict[str, Any] = {
                "name": checks.text(tool.get("name"), f"tools[{i}].name"),
                "parameters": checks.obj(tool.get("input_schema"), f"tools[{i}].input_schema"),
            }
            description = checks.optional_text(tool.get("description"), f"tools[{i}].description")
            if description is not None:
                function["description"] = description
            out.append({"type": "function", "function": function})
        if out:
            chat["tools"] = out
    choice = body.get("tool_choice")
    if choice is None:
        if chat.get("tools"):
            chat["tool_choice"] = "auto"
        return
    choice = checks.obj(choice, "tool_choice")
    kind = choice.get("type")
    if kind == "tool":
        name = checks.text(choice.get("name"), "tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif kind in _TOOL_CHOICES:
        chat["tool_choice"] = _TOOL_CHOICES[kind]
    else:
        raise BadRequest(f"tool_choice.type {kind!r:.40} is not known", param="tool_choice")
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


# -- the answer ------------------------------------------------------------------------------
def message_id(chat_id: Any) -> str:
    """A Messages id for a chat answer's id."""
    suffix = chat_id if isinstance(chat_id, str) and chat_id else uuid.uuid4().hex
    return f"msg_{suffix.removeprefix('chatcmpl-')}"


def stop_reason(
    finish_reason: str | None, matched: Any, tool_used: bool
) -> tuple[str | None, str | None]:
    """Anthropic's `(stop_reason, stop_sequence)` for a chat finish, as vLLM maps it: a
    cut-off is `max_tokens`, a matched stop string `stop_sequence`, a tool call
    `tool_use`, anything else `end_turn`."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return ("end_turn", None) if finish_reason is None else (None, None)
    if isinstance(matched, str):
        return "stop_sequence", matched
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as the `input` object (empty when the model wrote no JSON
    object; the recorded turn keeps what it wrote)."""
    try:
        value = orjson.loads(arguments) if arguments else {}
    except orjson.JSONDecodeError:
        log.warning("a tool call's arguments are not JSON: %.80s", arguments)
        return {}
    return value if isinstance(value, dict) else {}


def from_chat(chat: dict[str, Any], call: MessagesCall) -> dict[str, Any]:
    """The Messages answer for a whole chat answer."""
    choice = first_choice(chat) or {}
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    assert isinstance(message, dict)
    content: list[dict[str, Any]] = []
    reasoning = reasoning_of(message)
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": uuid.uuid4().hex})
    text = text_or_none(message.get("content"))
    if text:
        content.append({"type": "text", "text": text})
    calls = [c for c in message.get("tool_calls") or () if isinstance(c, dict)]
    for tool_call in calls:
        fn = tool_call.get("function") if isinstance(tool_call.get("function"), dict) else {}
        assert isinstance(fn, dict)
        content.append(
            {
                "type": "tool_use",
                "id": str(tool_call.get("id") or f"toolu_{uuid.uuid4().hex}"),
                "name": str(fn.get("name") or ""),
                "input": tool_input(str(fn.get("arguments") or "")),
            }
        )
    if not content:
        content.append({"type": "text", "text": ""})
    reason, sequence = stop_reason(
        text_or_none(choice.get("finish_reason")), choice.get("stop_reason"), bool(calls)
    )
    counts = usage_counts(chat) or (0, 0)
    return {
        "id": message_id(chat.get("id")),
        "type": "message",
        "role": "assistant",
        "model": call.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {"input_tokens": counts[0], "output_tokens": counts[1]},
    }


def error_body(exc: TurnstileError) -> bytes:
    """`exc` in Anthropic's error shape."""
    default = "api_error" if exc.status >= 500 else "invalid_request_error"
    kind = _ERROR_TYPES.get(exc.status, default)
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": exc.message}})


def error_event(message: str) -> dict[str, Any]:
    """The stream's `error` event for a failure part-way."""
    return {"type": "error", "error": {"type": "api_error", "message": message}}
