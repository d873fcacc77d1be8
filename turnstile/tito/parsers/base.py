"""Shared types for turning sampled completion text into a Chat Completions message.

A parser receives the decoded text of a completion (whole, or in stream pieces) and
produces `ParsedDelta`s: content text, reasoning text, tool-call deltas in the OpenAI
streaming shape, and diagnostics for tool calls it could not parse. `ParsedMessage`
is the assistant message those deltas add up to. Every parser implements `parse` as
`feed` of the whole text followed by `finish`, so whole and streamed results agree.

Also here: the incremental helpers the format parsers share (partial-marker hold-back,
a JSON value span scanner, tool-call argument normalisation) and `finish_reason`.
"""

from __future__ import annotations

import codecs
import json
import secrets
import string
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

# Tool-call ids follow OpenAI's "call_<random>" shape; Mistral templates refuse any id
# that is not exactly nine ASCII letters and digits.
TOOL_CALL_ID_PREFIX = "call_"
TOOL_CALL_ID_RANDOM_CHARS = 24
MISTRAL_TOOL_CALL_ID_LENGTH = 9
_MISTRAL_ID_ALPHABET = string.ascii_letters + string.digits

FINISH_STOP = "stop"
FINISH_TOOL_CALLS = "tool_calls"

ReasoningField = Literal["reasoning", "reasoning_content", "both"]
"""Which key carries reasoning text: vLLM's `reasoning`, the older `reasoning_content`,
or both (for harnesses that read either)."""

IdFactory = Callable[[], str]


def new_tool_call_id() -> str:
    """A fresh OpenAI-style tool-call id, `call_` followed by random hex."""
    return TOOL_CALL_ID_PREFIX + uuid.uuid4().hex[:TOOL_CALL_ID_RANDOM_CHARS]


def new_mistral_tool_call_id() -> str:
    """A fresh Mistral tool-call id: nine random ASCII letters and digits."""
    return "".join(secrets.choice(_MISTRAL_ID_ALPHABET) for _ in range(MISTRAL_TOOL_CALL_ID_LENGTH))


def _reasoning_keys(reasoning_field: ReasoningField) -> tuple[str, ...]:
    if reasoning_field == "both":
        return ("reasoning", "reasoning_content")
    return (reasoning_field,)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One complete tool call; `arguments` is a JSON object serialised as a string."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a tool call in the Chat Completions streaming shape.

    `id` and `name` come on the first delta of a call (index `index`); `arguments`
    pieces concatenate to the call's arguments string.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        function["arguments"] = self.arguments
        out["function"] = function
        return out


@dataclass(slots=True)
class ParsedDelta:
    """What a parser can emit now: text, reasoning, tool-call pieces, diagnostics."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.content or self.reasoning or self.tool_calls or self.errors)

    def extend(self, other: ParsedDelta) -> None:
        """Append `other` (which comes after this delta) to this one in place."""
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)
        self.errors.extend(other.errors)

    def to_openai(self, reasoning_field: ReasoningField = "reasoning") -> dict[str, Any]:
        """The `delta` object of a streaming chunk (only the keys that carry something)."""
        out: dict[str, Any] = {}
        if self.content:
            out["content"] = self.content
        if self.reasoning:
            for key in _reasoning_keys(reasoning_field):
                out[key] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return out


@dataclass(slots=True)
class ParsedMessage:
    """The assistant message a completion parses to."""

    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @classmethod
    def from_deltas(cls, deltas: Iterable[ParsedDelta]) -> ParsedMessage:
        """Add up stream deltas: texts concatenate, call pieces join by `index`."""
        content: list[str] = []
        reasoning: list[str] = []
        errors: list[str] = []
        ids: dict[int, str] = {}
        names: dict[int, str] = {}
        arguments: dict[int, list[str]] = {}
        for delta in deltas:
            content.append(delta.content)
            reasoning.append(delta.reasoning)
            errors.extend(delta.errors)
            for piece in delta.tool_calls:
                if piece.id is not None:
                    ids.setdefault(piece.index, piece.id)
                if piece.name is not None:
                    names[piece.index] = names.get(piece.index, "") + piece.name
                arguments.setdefault(piece.index, []).append(piece.arguments)
        calls = [
            ToolCall(id=ids.get(i, ""), name=names.get(i, ""), arguments="".join(arguments[i]))
            for i in sorted(arguments)
        ]
        return cls(
            content="".join(content) or None,
            reasoning="".join(reasoning) or None,
            tool_calls=calls,
            errors=errors,
        )

    def to_openai(self, reasoning_field: ReasoningField = "reasoning") -> dict[str, Any]:
        """The Chat Completions `message` object (`tool_calls` only when there are any)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            for key in _reasoning_keys(reasoning_field):
                out[key] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return out


def finish_reason(backend_reason: str | None, parsed: ParsedMessage | bool) -> str | None:
    """The finish reason for the harness: `tool_calls` when calls were parsed and the
    backend stopped normally, otherwise the backend's reason (e.g. `length`) unchanged.

    `parsed` is the parsed message, or whether any tool call was emitted in a stream.
    """
    called = parsed if isinstance(parsed, bool) else bool(parsed.tool_calls)
    if called and backend_reason == FINISH_STOP:
        return FINISH_TOOL_CALLS
    return backend_reason


@runtime_checkable
class OutputParser(Protocol):
    """Turns completion text into message parts, incrementally.

    `feed` takes the next piece of text and returns what is decided so far; text that
    might still turn out to be part of a marker or a tool call is held back. `finish`
    flushes everything held back. `parse` does both for a whole text on a fresh parser.
    """

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...

    def parse(self, text: str) -> ParsedMessage: ...


class ReasoningSplitter(Protocol):
    """Splits completion text into (reasoning, content) pieces, incrementally."""

    def feed(self, text: str) -> tuple[str, str]: ...

    def finish(self) -> tuple[str, str]: ...


class BaseOutputParser(ABC):
    """Feed/finish bookkeeping and `parse` for concrete parsers (subclass `_feed`/`_finish`)."""

    def __init__(self) -> None:
        self._started = False
        self._finished = False

    def feed(self, text: str) -> ParsedDelta:
        if self._finished:
            raise RuntimeError("feed() after finish(): use a fresh parser per completion")
        self._started = True
        if not text:
            return ParsedDelta()
        return self._feed(text)

    def finish(self) -> ParsedDelta:
        if self._finished:
            return ParsedDelta()
        self._started = True
        self._finished = True
        return self._finish()

    def parse(self, text: str) -> ParsedMessage:
        if self._started:
            raise RuntimeError("parse() needs a fresh parser")
        return ParsedMessage.from_deltas([self.feed(text), self.finish()])

    @abstractmethod
    def _feed(self, text: str) -> ParsedDelta: ...

    @abstractmethod
    def _finish(self) -> ParsedDelta: ...


class Utf8Feeder:
    """Feeds a parser UTF-8 bytes in arbitrary pieces (e.g. per-token byte strings): a
    character split between pieces, inside a marker or not, is held until complete.
    Invalid bytes become U+FFFD, as detokenizers write them."""

    __slots__ = ("_decoder", "_parser")

    def __init__(self, parser: OutputParser) -> None:
        self._parser = parser
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> ParsedDelta:
        return self._parser.feed(self._decoder.decode(data))

    def finish(self) -> ParsedDelta:
        out = self._parser.feed(self._decoder.decode(b"", final=True))
        out.extend(self._parser.finish())
        return out


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest proper prefix of `marker` that `text` ends with."""
    longest = min(len(text), len(marker) - 1)
    for size in range(longest, 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def could_become(text: str, marker: str) -> bool:
    """Whether `text` is a proper prefix of `marker` (more text could complete it)."""
    return len(text) < len(marker) and marker.startswith(text)


class JsonSpanScanner:
    """Finds where a JSON object or array that starts at offset 0 of a growing buffer
    ends, looking at each character once however the buffer grows.

    Only brackets outside strings are counted; whether the span is valid JSON is left
    to `json.loads`.
    """

    __slots__ = ("_depth", "_escaped", "_in_string", "_pos")

    def __init__(self) -> None:
        self._pos = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def end(self, buf: str) -> int | None:
        """The index just past the closing bracket, or None while it has not arrived."""
        pos, depth, in_string, escaped = self._pos, self._depth, self._in_string, self._escaped
        result: int | None = None
        while pos < len(buf):
            char = buf[pos]
            pos += 1
            if in_string:
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth <= 0:
                    result = pos
                    break
        self._pos, self._depth, self._in_string, self._escaped = pos, depth, in_string, escaped
        return result


class ToolCallError(ValueError):
    """A tool-call candidate that does not have the expected shape."""


def loads_object(text: str) -> Any:
    """`json.loads`, with failures reported as `ToolCallError`."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ToolCallError(f"invalid JSON: {exc}") from exc


def call_name(obj: object) -> str:
    """The `name` of a decoded call object, which must be a non-empty string."""
    if not isinstance(obj, dict):
        raise ToolCallError("a tool call must be a JSON object")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ToolCallError('a tool call needs a non-empty string "name"')
    return name


def arguments_json(value: object) -> str:
    """A call's arguments as the JSON string clients receive.

    Serialised as vLLM does (`json.dumps(args, ensure_ascii=False)`, default separators,
    key order kept), which is also how Hugging Face templates' `tojson` re-renders them.
    A missing value means no arguments; a string holding a JSON object is unwrapped.
    """
    if value is None:
        value = {}
    elif isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ToolCallError("string arguments are not a JSON object") from exc
    if not isinstance(value, dict):
        raise ToolCallError("tool-call arguments must be a JSON object")
    return json.dumps(value, ensure_ascii=False)
