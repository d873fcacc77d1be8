"""OpenAI Responses <-> Chat Completions, for `POST /v1/responses`.

`to_chat` turns a Responses request into the chat request Turnstile forwards (and
records): `instructions` become the leading system message, the conversation named by
`previous_response_id` (see `conversations`) comes next without them, then the input
items: messages (`developer` as `system`, which chat templates know), `reasoning` items
as an assistant message's `reasoning`, `function_call` items as its `tool_calls` and
`function_call_output` items as `tool` messages, merged as vLLM 0.32's `/v1/responses`
merges them. Function tools become chat tools, and a namespace tool's functions too,
named `namespace__name` as vLLM flattens them (Codex's sub-agent tools); hosted tools (web
search, file search, ...) are left out, as vLLM leaves them out for a chat model, and so
are custom (free-form) tools for now.

Images: an `input_image` part (a data URL or an http(s) URL in `image_url`, with its
`detail` kept where given) in a user, system or developer message, or in a
`function_call_output`'s output list, becomes a chat `image_url` part; such a message's
content is then a list of `text` and `image_url` parts in the order given (which the chat
template and `turnstile.proxy.media` rely on), while text-only content stays one string,
as before. An image by `file_id` is refused (422: Turnstile has no Files API), and so are
images in assistant messages, `input_file` and audio parts.

`from_chat` and `response_object` write the answer: a `reasoning` item, a `message` item
with its `output_text`, and one `function_call` item per tool call (with its `namespace`
where it has one); `assistant_message` is the chat message stored as the answer's step of
the conversation. Errors keep the OpenAI shape Turnstile already uses.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from turnstile.errors import BadRequest, Unprocessable
from turnstile.protocols import checks
from turnstile.protocols.common import (
    chat_content,
    first_choice,
    reasoning_of,
    text_or_none,
    usage_counts,
)

log = logging.getLogger("turnstile.protocols.responses")

_SAMPLING: Final[dict[str, str]] = {"temperature": "temperature", "top_p": "top_p"}
# Between a namespace tool's name and its function's name in the flattened chat tool name.
NAMESPACE_SEPARATOR: Final[str] = "__"
_TEXT_PARTS: Final[frozenset[str]] = frozenset({"input_text", "output_text", "text", "refusal"})
_IMAGE_DETAILS: Final[frozenset[str]] = frozenset({"auto", "low", "high", "original"})
_IMAGE_SCHEMES: Final[frozenset[str]] = frozenset({"data", "http", "https"})
_ROLES: Final[dict[str, str]] = {
    "user": "user",
    "assistant": "assistant",
    "system": "system",
    "developer": "system",
}
# Request fields echoed back in the response object, as the Responses API does.
_ECHOED: Final[tuple[str, ...]] = (
    "instructions",
    "max_output_tokens",
    "metadata",
    "previous_response_id",
    "reasoning",
    "store",
    "temperature",
    "text",
    "top_p",
    "truncation",
    "user",
)


@dataclass(slots=True)
class ResponsesCall:
    """What the answer needs from the request."""

    response_id: str
    model: str
    stream: bool
    previous_response_id: str | None
    added: list[dict[str, Any]]  # this call's input, as chat messages (no instructions)
    echo: dict[str, Any] = field(default_factory=dict)
    created_at: int = field(default_factory=lambda: int(time.time()))
    # flattened chat tool name -> (name, namespace) of a namespace tool's function
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)

    def call_name(self, flat: str) -> dict[str, str]:
        """A chat tool call's name as the function call item names it."""
        if flat in self.namespaced:
            name, namespace = self.namespaced[flat]
            return {"name": name, "namespace": namespace}
        return {"name": flat}


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def to_chat(
    body: Any, history: Callable[[str], list[dict[str, Any]]]
) -> tuple[dict[str, Any], ResponsesCall]:
    """The chat request for a Responses request; `history` gives the conversation of a
    `previous_response_id` (400 for one that cannot be served, 422 for what Turnstile
    cannot translate yet)."""
    body = checks.obj(body, "body")
    model = checks.text(body.get("model"), "model")
    for unsupported in ("background", "conversation", "prompt"):
        if body.get(unsupported) not in (None, False):
            raise Unprocessable(f"'{unsupported}' is not supported", param=unsupported)
    instructions = checks.optional_text(body.get("instructions"), "instructions")
    previous = checks.optional_text(body.get("previous_response_id"), "previous_response_id")
    added = _input_messages(body.get("input"))
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if previous is not None:
        messages += history(previous)
    messages += added
    if not messages:
        raise BadRequest("the request has no input", param="input")
    chat: dict[str, Any] = {"model": model, "messages": messages}
    tools, namespaced = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    _tool_choice(body.get("tool_choice"), chat)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = checks.positive_int(body["max_output_tokens"], "max_output_tokens")
    checks.copy_numbers(body, chat, _SAMPLING)
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = checks.boolean(
            body["parallel_tool_calls"], "parallel_tool_calls"
        )
    _text_format(body.get("text"), chat)
    stream = checks.boolean(body.get("stream", False), "stream")
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    # The prompt's token ids come back in the first chunk: its input token count.
    chat["return_token_ids"] = True
    echo = {name: body.get(name) for name in _ECHOED}
    echo["tools"] = body.get("tools") or []
    echo["tool_choice"] = body.get("tool_choice") or "auto"
    echo["parallel_tool_calls"] = body.get("parallel_tool_calls", True)
    call = ResponsesCall(new_response_id(), model, stream, previous, added, echo)
    call.namespaced = namespaced
    return chat, call


def _input_messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(checks.array(value, "input")):
        _add_item(checks.obj(item, f"input[{i}]"), f"input[{i}]", out)
    return out


def _open_assistant(out: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last message if it is an assistant message items may still be merged into."""
    if out and out[-1]["role"] == "assistant":
        return out[-1]
    return None


def _add_item(item: dict[str, Any], at: str, out: list[dict[str, Any]]) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise BadRequest(f"{at}.role {role!r:.40} is not known", param="input")
        images = role != "assistant"  # a chat template lays images out in prompt turns only
        content = _content(item.get("content"), f"{at}.content", images=images)
        last = _open_assistant(out)
        if role == "assistant" and last is not None and last.get("content") is None:
            last["content"] = content  # after its reasoning item
            return
        out.append({"role": _ROLES[role], "content": content})
    elif kind == "function_call":
        name = checks.text(item.get("name"), f"{at}.name")
        namespace = checks.optional_text(item.get("namespace"), f"{at}.namespace")
        call = {
            "id": checks.text(item.get("call_id"), f"{at}.call_id"),
            "type": "function",
            "function": {
                "name": name if namespace is None else flat_name(namespace, name),
                "arguments": checks.text(item.get("arguments"), f"{at}.arguments"),
            },
        }
        last = _open_assistant(out)
        if last is None:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            last.setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        output = _content(item.get("output"), f"{at}.output", images=True)
        call_id = checks.text(item.get("call_id"), f"{at}.call_id")
        out.append({"role": "tool", "tool_call_id": call_id, "content": output})
    elif kind == "reasoning":
        reasoning = _reasoning_text(item, at)
        if reasoning is not None:
            out.append({"role": "assistant", "content": None, "reasoning": reasoning})
    else:
        raise Unprocessable(
            f"{at}: input items of type {kind!r:.40} are not supported", param="input"
        )


def _content(value: Any, at: str, *, images: bool) -> str | list[dict[str, Any]]:
    """Message content for chat: text parts joined into one string with newlines, as vLLM
    joins them before a chat template renders them (and as TITO's own rendering needs);
    with an image among them (where `images` allows them), a list of `text` and
    `image_url` parts in their order instead."""
    if isinstance(value, str):
        return value
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(checks.array(value, at)):
        where = f"{at}[{j}]"
        part = checks.obj(part, where)
        kind = part.get("type")
        if kind == "input_image" and images:
            parts.append(_image_part(part, where))
        elif kind in _TEXT_PARTS:
            field_name = "refusal" if kind == "refusal" else "text"
            text = checks.text(part.get(field_name), f"{where}.{field_name}")
            parts.append({"type": "text", "text": text})
        elif kind == "input_image":
            raise Unprocessable(
                f"{where}: images are supported in user, system and developer messages and "
                "function call outputs only",
                param="input",
            )
        else:
            raise Unprocessable(f"{where}: {kind!r:.40} content is not supported", param="input")
    return chat_content(parts)


def _image_part(part: dict[str, Any], at: str) -> dict[str, Any]:
    """An `input_image` part as a chat `image_url` part (`detail` kept where given)."""
    url = part.get("image_url")
    if url is None and part.get("file_id") is not None:
        raise Unprocessable(
            f"{at}.file_id: images by file id are not supported (Turnstile has no Files "
            "API); send the image inline as a data URL or by http(s) URL in image_url",
            param=f"{at}.file_id",
        )
    if not isinstance(url, str) or not url:
        raise BadRequest(
            f"{at}.image_url must be a non-empty string (a data URL or an http(s) URL)",
            param=f"{at}.image_url",
        )
    scheme, colon, _ = url.partition(":")
    if not colon or scheme.lower() not in _IMAGE_SCHEMES:
        raise BadRequest(
            f"{at}.image_url must be a data URL or an http(s) URL", param=f"{at}.image_url"
        )
    image_url: dict[str, Any] = {"url": url}
    detail = part.get("detail")
    if detail is not None:
        if not isinstance(detail, str) or detail not in _IMAGE_DETAILS:
            raise BadRequest(
                f"{at}.detail must be one of {', '.join(sorted(_IMAGE_DETAILS))}",
                param=f"{at}.detail",
            )
        image_url["detail"] = detail
    return {"type": "image_url", "image_url": image_url}


def _reasoning_text(item: dict[str, Any], at: str) -> str | None:
    """A reasoning item's text: its content, else its summary; None when it holds only
    encrypted content (which no open model can read)."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts:
            texts = [
                checks.text(checks.obj(p, f"{at}.{key}").get("text"), f"{at}.{key}.text")
                for p in checks.array(parts, f"{at}.{key}")
            ]
            return "".join(texts)
    return None


def flat_name(namespace: str, name: str) -> str:
    """A namespace tool's function as one chat tool name, as vLLM flattens it."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def _tools(value: Any) -> tuple[list[dict[str, Any]], dict[str, tuple[str, str]]]:
    """The chat tools (a namespace's functions flattened to `namespace__name`), and the
    flattened names' `(name, namespace)`."""
    tools: list[dict[str, Any]] = []
    namespaced: dict[str, tuple[str, str]] = {}
    for i, tool in enumerate(checks.array(value or [], "tools")):
        tool = checks.obj(tool, f"tools[{i}]")
        if tool.get("type") == "namespace":
            namespace = checks.text(tool.get("name"), f"tools[{i}].name")
            for j, inner in enumerate(checks.array(tool.get("tools") or [], f"tools[{i}].tools")):
                inner = checks.obj(inner, f"tools[{i}].tools[{j}]")
                if inner.get("type") == "function":
                    function = _function(inner, f"tools[{i}].tools[{j}]")
                    namespaced[flat_name(namespace, function["name"])] = (
                        function["name"],
                        namespace,
                    )
                    function["name"] = flat_name(namespace, function["name"])
                    tools.append({"type": "function", "function": function})
        elif tool.get("type") == "function":
            tools.append({"type": "function", "function": _function(tool, f"tools[{i}]")})
        else:
            log.debug("tool of type %r left out (not a function tool)", tool.get("type"))
    return tools, namespaced


def _function(tool: dict[str, Any], at: str) -> dict[str, Any]:
    function: dict[str, Any] = {"name": checks.text(tool.get("name"), f"{at}.name")}
    description = checks.optional_text(tool.get("description"), f"{at}.description")
    if description is not None:
        function["description"] = description
    if tool.get("parameters") is not None:
        function["parameters"] = checks.obj(tool["parameters"], f"{at}.parameters")
    if tool.get("strict") is not None:
        function["strict"] = checks.boolean(tool["strict"], f"{at}.strict")
    return function


def _tool_choice(value: Any, chat: dict[str, Any]) -> None:
    if value is None:
        if chat.get("tools"):
            chat["tool_choice"] = "auto"
        return
    if value in ("auto", "none", "required"):
        chat["tool_choice"] = value
        return
    choice = checks.obj(value, "tool_choice")
    if choice.get("type") != "function":
        raise Unprocessable(
            f"tool_choice of type {choice.get('type')!r:.40} is not supported", param="tool_choice"
        )
    name = checks.text(choice.get("name"), "tool_choice.name")
    chat["tool_choice"] = {"type": "function", "function": {"name": name}}


def _text_format(value: Any, chat: dict[str, Any]) -> None:
    if value is None:
        return
    fmt = checks.obj(value, "text").get("format")
    if fmt is None:
        return
    fmt = checks.obj(fmt, "text.format")
    kind = fmt.get("type")
    if kind == "json_schema":
        schema: dict[str, Any] = {
            "name": checks.text(fmt.get("name"), "text.format.name"),
            "schema": checks.obj(fmt.get("schema"), "text.format.schema"),
        }
        if fmt.get("strict") is not None:
            schema["strict"] = checks.boolean(fmt["strict"], "text.format.strict")
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif kind != "text":
        raise BadRequest(f"text.format.type {kind!r:.40} is not known", param="text")


# -- the answer ------------------------------------------------------------------------------
def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    parts = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": parts,
    }


def function_call_item(
    item_id: str, call_id: str, name: dict[str, str], arguments: str, status: str
) -> dict[str, Any]:
    """A function call item; `name` is `ResponsesCall.call_name`'s (with its namespace)."""
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        **name,
        "arguments": arguments,
        "status": status,
    }


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def assistant_message(
    content: str | None, reasoning: str | None, tool_calls: list[dict[str, Any]]
) -> dict[str, Any]:
    """The answer as the chat message stored for `previous_response_id`."""
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def usage_object(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response_object(
    call: ResponsesCall,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    *,
    incomplete: bool = False,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `response` object (also inside the stream's lifecycle events)."""
    return {
        "id": call.response_id,
        "object": "response",
        "created_at": call.created_at,
        "status": status,
        "model": call.model,
        "output": output,
        "usage": usage,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        **call.echo,
    }


def from_chat(chat: dict[str, Any], call: ResponsesCall) -> tuple[dict[str, Any], dict[str, Any]]:
    """The response object for a whole chat answer, and the answer as a chat message."""
    choice = first_choice(chat) or {}
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    assert isinstance(message, dict)
    output: list[dict[str, Any]] = []
    reasoning = reasoning_of(message)
    if reasoning:
        output.append(reasoning_item(item_id("rs"), reasoning, "completed"))
    text = text_or_none(message.get("content"))
    if text:
        output.append(message_item(item_id("msg"), text, "completed"))
    calls: list[dict[str, Any]] = []
    for tool_call in message.get("tool_calls") or ():
        if not isinstance(tool_call, dict):
            continue
        fn = tool_call.get("function") if isinstance(tool_call.get("function"), dict) else {}
        assert isinstance(fn, dict)
        call_id = str(tool_call.get("id") or item_id("call"))
        name, arguments = str(fn.get("name") or ""), str(fn.get("arguments") or "")
        item = function_call_item(
            item_id("fc"), call_id, call.call_name(name), arguments, "completed"
        )
        output.append(item)
        calls.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        )
    counts = usage_counts(chat) or (0, 0)
    incomplete = choice.get("finish_reason") == "length"
    status = "incomplete" if incomplete else "completed"
    body = response_object(call, status, output, usage_object(*counts), incomplete=incomplete)
    return body, assistant_message(text, reasoning, calls)
