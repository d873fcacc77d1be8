"""Tool-call parsers: find the calls a model wrote in its content text.

Each parser follows the format of the vLLM tool parser of the same name:

* `hermes` (Hermes 2 Pro / 3, Qwen2.5, Qwen3): `<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>`, any number of them. Arguments are re-serialised with
  `json.dumps(args, ensure_ascii=False)` as vLLM does. A final `<tool_call>` without
  its closing tag still counts if its body is a whole call (generation stopped there).
* `llama3_json` (Llama 3.1 / 3.2 / 3.3): the message is JSON calls
  `{"name": ..., "parameters": {...}}` (or `"arguments"`), optionally after
  `<|python_tag|>`, separated by `;`. A message that does not start with `{` or the
  tag is plain content; text after the calls is content.
* `mistral`: `[TOOL_CALLS]` followed by a JSON list of `{"name", "arguments"}` (Mistral
  Nemo and other pre-v11 tokenizers), or by `name[ARGS]{...}` per call (v11+: Mistral
  Small 3.2, Devstral, Ministral 3), optionally with `[CALL_ID]id` before `[ARGS]`.
  v11 arguments are passed on verbatim, as vLLM does; list-form arguments are
  re-serialised. Call ids are Mistral's nine letters and digits (templates reject
  others); an id the model wrote is kept.
* `plain`: content only.

Shared rules. A call is emitted whole (id, name and arguments in one delta) once its
text is complete, because until then it could still prove malformed. A malformed call
never raises: its text stays in `content`, verbatim, and `errors` says why. Whitespace
just before a call, and whitespace that ends the message after a call, is dropped
(chat templates write their own separators when the message is rendered again), so
trailing whitespace is held back until the next non-space character decides it; all
other text is kept verbatim, and a message without calls is its text unchanged.

Where this knowingly differs from vLLM: text after calls stays content (vLLM's hermes
and llama3_json drop it), whitespace before a call is dropped (vLLM keeps it), and a
Mistral v11 call whose arguments are not a JSON object stays content (vLLM emits it).

Parsers expect text decoded with special tokens kept (`skip_special_tokens=False`),
or markers such as `[TOOL_CALLS]` are lost.
"""

from __future__ import annotations

import re
from enum import Enum, auto

from turnstile.tito.parsers.base import (
    BaseOutputParser,
    IdFactory,
    JsonSpanScanner,
    ParsedDelta,
    ToolCallDelta,
    ToolCallError,
    arguments_json,
    call_name,
    could_become,
    loads_object,
    new_mistral_tool_call_id,
    new_tool_call_id,
    partial_marker_len,
)

HERMES_CALL_START = "<tool_call>"
HERMES_CALL_END = "</tool_call>"
LLAMA_PYTHON_TAG = "<|python_tag|>"
LLAMA_CALL_SEPARATOR = ";"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
MISTRAL_CALL_ID = "[CALL_ID]"

# Text between `[TOOL_CALLS]` and the arguments' `{` longer than this is not a name.
MAX_MISTRAL_NAME_REGION = 256
_MISTRAL_NAME_REGION = re.compile(
    r"(?P<name>[^\s\[\]{}]+)"
    + r"(?:"
    + re.escape(MISTRAL_CALL_ID)
    + r"(?P<id>[^\s\[\]{}]+))?"
    + r"(?:"
    + re.escape(MISTRAL_ARGS)
    + r")?"
)
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_NAME_KEY = '"name"'


class ToolParser(BaseOutputParser):
    """Bookkeeping shared by the tool-call parsers: the held-back buffer, call indices
    and ids, and the whitespace rules."""

    name = "tool"

    def __init__(self, *, id_factory: IdFactory | None = None) -> None:
        super().__init__()
        self._new_id: IdFactory = id_factory or new_tool_call_id
        self._buf = ""
        self._count = 0
        self._after_call = False  # nothing but whitespace since the last emitted call
        self._ws_before = ""  # whitespace dropped before the marker just found

    def _content(self, out: ParsedDelta, text: str) -> None:
        if text:
            out.content += text
            if not text.isspace():
                self._after_call = False

    def _call(self, out: ParsedDelta, name: str, arguments: str, call_id: str | None) -> None:
        delta = ToolCallDelta(
            index=self._count, id=call_id or self._new_id(), name=name, arguments=arguments
        )
        out.tool_calls.append(delta)
        self._count += 1
        self._after_call = True

    def _reject(self, out: ParsedDelta, raw: str, reason: str) -> None:
        out.errors.append(f"{self.name}: {reason}; kept as content")
        self._content(out, raw)

    def _text_until(self, out: ParsedDelta, marker: str) -> bool:
        """Emit decided content up to `marker`. True when the marker was found: the
        buffer then holds what follows it and `_ws_before` the whitespace before it."""
        at = self._buf.find(marker)
        if at >= 0:
            before = self._buf[:at]
            kept = before.rstrip()
            self._content(out, kept)
            self._ws_before = before[len(kept) :]
            self._buf = self._buf[at + len(marker) :]
            return True
        decided = self._buf[: len(self._buf) - partial_marker_len(self._buf, marker)]
        kept = decided.rstrip()  # trailing whitespace may precede a call
        self._content(out, kept)
        self._buf = self._buf[len(kept) :]
        return False

    def _finish_text(self, out: ParsedDelta) -> None:
        held, self._buf = self._buf, ""
        if not (self._after_call and held.isspace()):
            self._content(out, held)


class PlainParser(ToolParser):
    """Everything is content."""

    name = "plain"

    def _feed(self, text: str) -> ParsedDelta:
        return ParsedDelta(content=text)

    def _finish(self) -> ParsedDelta:
        return ParsedDelta()


class HermesParser(ToolParser):
    """`<tool_call>{json}</tool_call>` blocks (Hermes, Qwen2.5, Qwen3)."""

    name = "hermes"

    def __init__(self, *, id_factory: IdFactory | None = None) -> None:
        super().__init__(id_factory=id_factory)
        self._in_call = False
        self._search_from = 0

    def _feed(self, text: str) -> ParsedDelta:
        self._buf += text
        out = ParsedDelta()
        while True:
            if not self._in_call:
                if not self._text_until(out, HERMES_CALL_START):
                    break
                self._in_call = True
                self._search_from = 0
                continue
            at = self._buf.find(HERMES_CALL_END, self._search_from)
            if at < 0:
                self._search_from = max(0, len(self._buf) - len(HERMES_CALL_END) + 1)
                break
            body = self._buf[:at]
            self._buf = self._buf[at + len(HERMES_CALL_END) :]
            self._in_call = False
            raw = self._ws_before + HERMES_CALL_START + body + HERMES_CALL_END
            self._close(out, body, raw, "")
        return out

    def _close(self, out: ParsedDelta, body: str, raw: str, context: str) -> None:
        try:
            obj = loads_object(body)
            name = call_name(obj)
            args = obj.get("arguments", obj.get("parameters"))
            arguments = arguments_json(args)
        except ToolCallError as exc:
            self._reject(out, raw, context + str(exc))
        else:
            self._call(out, name, arguments, None)

    def _finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if not self._in_call:
            self._finish_text(out)
            return out
        body, self._buf = self._buf, ""
        complete = body[: len(body) - partial_marker_len(body, HERMES_CALL_END)]
        raw = self._ws_before + HERMES_CALL_START + body
        self._close(out, complete, raw, f"unterminated {HERMES_CALL_START}: ")
        return out


class _LlamaPhase(Enum):
    START = auto()  # before anything but whitespace
    EXPECT_OBJECT = auto()  # after the python tag or a separator
    OBJECT = auto()  # inside a JSON object
    BETWEEN = auto()  # after a call
    TEXT = auto()  # decided: the rest is content


class Llama3JsonParser(ToolParser):
    """JSON tool calls as the whole message (Llama 3.x, `llama3_json`)."""

    name = "llama3_json"

    def __init__(self, *, id_factory: IdFactory | None = None) -> None:
        super().__init__(id_factory=id_factory)
        self._phase = _LlamaPhase.START
        self._raw = ""  # consumed text not yet emitted, kept for a verbatim fallback
        self._tagged = False
        self._scanner = JsonSpanScanner()

    def _consume(self, size: int) -> None:
        self._raw += self._buf[:size]
        self._buf = self._buf[size:]

    def _give_up(self, out: ParsedDelta, extra: str, reason: str | None) -> None:
        raw, self._raw = self._raw + extra, ""
        if reason is None:
            self._content(out, raw)
        else:
            self._reject(out, raw, reason)
        self._phase = _LlamaPhase.TEXT

    def _start_object(self, leading: int) -> None:
        self._consume(leading)
        self._phase = _LlamaPhase.OBJECT
        self._scanner = JsonSpanScanner()

    def _feed(self, text: str) -> ParsedDelta:
        self._buf += text
        out = ParsedDelta()
        while self._buf:
            phase = self._phase
            if phase is _LlamaPhase.TEXT:
                self._content(out, self._buf)
                self._buf = ""
                break
            if phase is _LlamaPhase.OBJECT:
                if not self._object(out):
                    break
                continue
            stripped = self._buf.lstrip()
            leading = len(self._buf) - len(stripped)
            if not stripped:
                break
            if phase is _LlamaPhase.START:
                if could_become(stripped, LLAMA_PYTHON_TAG):
                    break
                if stripped.startswith(LLAMA_PYTHON_TAG):
                    self._tagged = True
                    self._consume(leading + len(LLAMA_PYTHON_TAG))
                    self._phase = _LlamaPhase.EXPECT_OBJECT
                elif stripped[0] == "{":
                    self._start_object(leading)
                else:
                    self._give_up(out, "", None)
            elif phase is _LlamaPhase.EXPECT_OBJECT:
                if stripped[0] == "{":
                    self._start_object(leading)
                else:
                    reason = "no JSON object after the python tag" if not self._count else None
                    self._give_up(out, "", reason)
            elif stripped[0] == LLAMA_CALL_SEPARATOR:
                self._consume(leading + len(LLAMA_CALL_SEPARATOR))
                self._phase = _LlamaPhase.EXPECT_OBJECT
            elif stripped[0] == "{":
                self._start_object(leading)
            else:
                self._give_up(out, "", None)
        return out

    def _object(self, out: ParsedDelta) -> bool:
        end = self._scanner.end(self._buf)
        if end is None:
            return False
        span, self._buf = self._buf[:end], self._buf[end:]
        try:
            obj = loads_object(span)
            name = call_name(obj)
            # Unlike the marked formats, a bare object needs its arguments key to count.
            if "parameters" in obj:
                arguments = arguments_json(obj["parameters"])
            elif "arguments" in obj:
                arguments = arguments_json(obj["arguments"])
            else:
                raise ToolCallError('a call needs "parameters" or "arguments"')
        except ToolCallError as exc:
            self._give_up(out, span, str(exc) if self._looks_like_call(span) else None)
        else:
            self._raw = ""
            self._call(out, name, arguments, None)
            self._phase = _LlamaPhase.BETWEEN
        return True

    def _looks_like_call(self, span: str) -> bool:
        # A JSON answer that is no call at all is ordinary content, not a failed call.
        return self._tagged or self._count > 0 or _NAME_KEY in span

    def _finish(self) -> ParsedDelta:
        out = ParsedDelta()
        held, self._buf = self._raw + self._buf, ""
        self._raw = ""
        phase = self._phase
        if phase is _LlamaPhase.OBJECT:
            reason = "unterminated JSON object" if self._looks_like_call(held) else None
            if reason is None:
                self._content(out, held)
            else:
                self._reject(out, held, reason)
        elif phase is _LlamaPhase.EXPECT_OBJECT and not self._count:
            self._reject(out, held, "no JSON object after the python tag")
        elif phase is _LlamaPhase.START or held.replace(LLAMA_CALL_SEPARATOR, "", 1).strip():
            self._content(out, held)
        return out


class _MistralPhase(Enum):
    TEXT = auto()
    AFTER_MARKER = auto()  # list or name form not decided yet
    NAME = auto()  # `name[CALL_ID]id[ARGS]` up to the arguments' `{`
    ARGS = auto()  # the v11 arguments object
    LIST = auto()  # the pre-v11 JSON list


class MistralParser(ToolParser):
    """`[TOOL_CALLS]` tool calls in both Mistral forms."""

    name = "mistral"

    def __init__(self, *, id_factory: IdFactory | None = None) -> None:
        super().__init__(id_factory=id_factory or new_mistral_tool_call_id)
        self._phase = _MistralPhase.TEXT
        self._raw = ""
        self._scanner = JsonSpanScanner()
        self._call_name = ""
        self._call_id: str | None = None

    def _consume(self, size: int) -> None:
        self._raw += self._buf[:size]
        self._buf = self._buf[size:]

    def _fail(self, out: ParsedDelta, extra: str, reason: str) -> None:
        raw, self._raw = self._raw + extra, ""
        self._reject(out, raw, reason)
        self._phase = _MistralPhase.TEXT

    def _feed(self, text: str) -> ParsedDelta:
        self._buf += text
        out = ParsedDelta()
        while self._step(out):
            pass
        return out

    def _step(self, out: ParsedDelta) -> bool:
        """One state transition; False when more text is needed."""
        phase = self._phase
        if phase is _MistralPhase.TEXT:
            if not self._text_until(out, MISTRAL_TOOL_CALLS):
                return False
            self._raw = self._ws_before + MISTRAL_TOOL_CALLS
            self._phase = _MistralPhase.AFTER_MARKER
            return True
        if phase is _MistralPhase.AFTER_MARKER:
            stripped = self._buf.lstrip()
            if not stripped:
                return False
            if stripped[0] == "[":
                inner = stripped[1:].lstrip()
                if not inner:
                    return False
                if inner[0] in "{]":
                    self._consume(len(self._buf) - len(stripped))
                    self._phase = _MistralPhase.LIST
                    self._scanner = JsonSpanScanner()
                    return True
            self._consume(len(self._buf) - len(stripped))
            self._phase = _MistralPhase.NAME
            return True
        if phase is _MistralPhase.NAME:
            return self._name(out)
        end = self._scanner.end(self._buf)
        if end is None:
            return False
        span, self._buf = self._buf[:end], self._buf[end:]
        if phase is _MistralPhase.ARGS:
            self._args(out, span)
        else:
            self._list(out, span)
        return True

    def _name(self, out: ParsedDelta) -> bool:
        brace = self._buf.find("{")
        region = self._buf if brace < 0 else self._buf[:brace]
        inner_space = any(char.isspace() for char in region.rstrip())
        if inner_space or len(region) > MAX_MISTRAL_NAME_REGION:
            self._fail(out, "", f"no tool name after {MISTRAL_TOOL_CALLS}")
            return True
        if brace < 0:
            return False
        match = _MISTRAL_NAME_REGION.fullmatch(region.strip())
        if match is None:
            self._fail(out, "", f"no tool name after {MISTRAL_TOOL_CALLS}")
            return True
        self._call_name = match.group("name")
        self._call_id = match.group("id")
        self._consume(brace)
        self._phase = _MistralPhase.ARGS
        self._scanner = JsonSpanScanner()
        return True

    def _args(self, out: ParsedDelta, span: str) -> None:
        try:
            if not isinstance(loads_object(span), dict):
                raise ToolCallError("tool-call arguments must be a JSON object")
        except ToolCallError as exc:
            self._fail(out, span, str(exc))
            return
        self._raw = ""
        self._call(out, self._call_name, span, self._call_id)
        self._phase = _MistralPhase.TEXT

    def _list(self, out: ParsedDelta, span: str) -> None:
        calls: list[tuple[str, str, str | None]] = []
        try:
            items = loads_object(span)
            if not isinstance(items, list) or not items:
                raise ToolCallError("tool calls must be a non-empty JSON list")
            for item in items:
                name = call_name(item)
                item_id = item.get("id")
                valid_id = isinstance(item_id, str) and _MISTRAL_ID.fullmatch(item_id)
                kept_id = item_id if valid_id else None
                calls.append((name, arguments_json(item.get("arguments")), kept_id))
        except ToolCallError as exc:
            self._fail(out, span, str(exc))
            return
        self._raw = ""
        for name, arguments, call_id in calls:
            self._call(out, name, arguments, call_id)
        self._phase = _MistralPhase.TEXT

    def _finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._phase is _MistralPhase.TEXT:
            self._finish_text(out)
            return out
        held, self._buf = self._buf, ""
        reason = {
            _MistralPhase.AFTER_MARKER: f"nothing after {MISTRAL_TOOL_CALLS}",
            _MistralPhase.NAME: f"no arguments after {MISTRAL_TOOL_CALLS}",
        }.get(self._phase, "unterminated JSON")
        self._fail(out, held, reason)
        return out
