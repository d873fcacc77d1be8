"""What the protocol translations share: reading the proxy's chat answer, live.

A translated call is a Chat Completions call through `Proxy.complete`; its answer comes
back as the chat JSON body or as the chat SSE bytes the proxy relays. `translate_stream`
parses those bytes as they arrive and hands each chunk to a protocol's `StreamTranslator`,
yielding its events at once (nothing is held back to the end). The proxy's own error
event (`{"error": ...}` after a backend failure) and `[DONE]` reach the translator as
`error` and `done`. The small readers below check the shapes the translators rely on;
`chat_content` is the one way both lay out a translated message's content.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

import orjson

from turnstile.errors import TurnstileError
from turnstile.proxy.sse import DONE, SSEParser

log = logging.getLogger("turnstile.protocols")


class StreamTranslator(Protocol):
    """Turns chat stream chunks into one protocol's SSE events (bytes to send)."""

    def start(self) -> bytes:
        """Events to send before the first chunk (may be empty)."""
        ...

    def chunk(self, obj: dict[str, Any]) -> bytes:
        """Events for one chat chunk."""
        ...

    def done(self) -> bytes:
        """Events after the chat stream's `[DONE]`: the protocol's end of stream."""
        ...

    def error(self, message: str) -> bytes:
        """The protocol's error event for a stream that failed part-way."""
        ...


async def translate_stream(
    chunks: AsyncIterator[bytes], translator: StreamTranslator
) -> AsyncIterator[bytes]:
    """The protocol's events for the proxy's chat stream `chunks`, each sent as soon as the
    chat bytes it comes from arrive. Closing this iterator closes `chunks` (the proxy then
    records the turn as aborted and closes the backend request)."""
    parser = SSEParser()
    finished = False
    try:
        first = translator.start()
        if first:
            yield first
        async for piece in chunks:
            out: list[bytes] = []
            for event in parser.feed(piece):
                if finished or event.data is None:
                    continue
                data = event.data.strip()
                if data == DONE:
                    out.append(translator.done())
                    finished = True
                    continue
                try:
                    obj = orjson.loads(data)
                except orjson.JSONDecodeError:
                    out.append(translator.error("Turnstile relayed a chat event that is not JSON"))
                    finished = True
                    continue
                if not isinstance(obj, dict):
                    continue
                if "error" in obj and not obj.get("choices"):
                    out.append(translator.error(error_message(obj)))
                    finished = True
                    continue
                out.append(translator.chunk(obj))
            joined = b"".join(out)
            if joined:
                yield joined
        if not finished:
            yield translator.error("the stream ended before it was complete")
    except TurnstileError as exc:  # a chunk that cannot be translated, a store that failed
        if not finished:
            yield translator.error(exc.message)
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()


def sse_event(name: str, obj: Any) -> bytes:
    """One named SSE event (`event:` line and JSON `data:` line)."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


def error_message(obj: dict[str, Any]) -> str:
    """The message of an OpenAI-style `{"error": ...}` object."""
    err = obj.get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return str(err["message"])
    return str(err)


def first_choice(obj: dict[str, Any]) -> dict[str, Any] | None:
    """A chat answer's or chunk's first choice, if it has one."""
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return None


def text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def tool_call_deltas(delta: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool-call fragments of a chat delta (or message), objects only."""
    calls = delta.get("tool_calls")
    if not isinstance(calls, list):
        return []
    return [c for c in calls if isinstance(c, dict)]


def tool_call_fragment(call: dict[str, Any]) -> tuple[int, str | None, str | None]:
    """`(index, name, arguments)` of one tool-call fragment of a chat delta: the index 0
    when it is missing or not an integer, the name and arguments None unless strings."""
    index = call.get("index", 0)
    fn = call.get("function")
    if not isinstance(fn, dict):
        fn = {}
    return (
        index if isinstance(index, int) else 0,
        text_or_none(fn.get("name")),
        text_or_none(fn.get("arguments")),
    )


def usage_counts(obj: dict[str, Any]) -> tuple[int, int] | None:
    """`(prompt_tokens, completion_tokens)` of a chat answer's usage, if it has one."""
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return prompt, completion


def reasoning_of(message: dict[str, Any]) -> str | None:
    """The reasoning text of a chat message or delta (vLLM 0.32: `reasoning`; older:
    `reasoning_content`)."""
    value = message.get("reasoning")
    if not isinstance(value, str):
        value = message.get("reasoning_content")
    return value if isinstance(value, str) else None


def chat_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A translated message's chat content from its `text` and `image_url` parts: the text
    joined with newlines into one string, as vLLM joins text parts before a chat template
    renders them (and as TITO's own rendering needs); with an image among them, the parts
    themselves, in their order (which the template and `turnstile.proxy.media` rely on)."""
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)
