"""The parser registry: names to parsers, and a chat template to the parser it needs.

Tool-call parsers and reasoning splitters are registered separately and combined by
`get_parser` (or `ParserSpec.build`). `parser_for_template` reads a chat template's
text: each registered detector is asked in turn, newest registration first (so plug-ins
win over the built-ins), and the reasoning splitter's `starts_in_reasoning` is found by
rendering the template's generation prompt and checking whether it leaves a reasoning
block open.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from typing import Any, NoReturn, Protocol

from turnstile.tito.parsers.base import IdFactory, OutputParser, ReasoningSplitter
from turnstile.tito.parsers.reasoning import (
    MISTRAL_THINK_END,
    MISTRAL_THINK_START,
    THINK_END,
    THINK_START,
    ReasoningOutputParser,
    ThinkSplitter,
    prompt_ends_in_reasoning,
)
from turnstile.tito.parsers.tools import (
    HERMES_CALL_START,
    LLAMA_PYTHON_TAG,
    MISTRAL_TOOL_CALLS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    PlainParser,
)

PLAIN = "plain"
LLAMA3_HEADER = "<|start_header_id|>"
QWEN3_CODER_FUNCTION = "<function="
GLM_ARG_KEY = "<arg_key>"
DEEPSEEK_TOOL_CALLS = "<\uff5ctool\u2581calls\u2581begin\uff5c>"

# Tool-call syntaxes seen in templates that no built-in parser reads: such templates
# get the plain parser (calls stay in content) and a note saying why.
UNSUPPORTED_TOOL_MARKERS: dict[str, str] = {
    QWEN3_CODER_FUNCTION: "Qwen3-Coder XML tool calls (<function=...>)",
    GLM_ARG_KEY: "GLM tool calls (<arg_key>/<arg_value>)",
    DEEPSEEK_TOOL_CALLS: "DeepSeek tool calls (<\uff5ctool\u2581calls\u2581begin\uff5c>)",
}

# What the template is rendered with to see its generation prompt.
_PROBE_MESSAGES = [{"role": "user", "content": "Hello"}]

TemplateDetector = Callable[[str], bool]


class ToolParserFactory(Protocol):
    """Makes a fresh tool-call parser (`OutputParser`) for one completion."""

    def __call__(self, *, id_factory: IdFactory | None = None) -> OutputParser: ...


class ReasoningFactory(Protocol):
    """Makes a fresh reasoning splitter; None means the splitter's own default."""

    def __call__(self, *, starts_in_reasoning: bool | None = None) -> ReasoningSplitter: ...


class UnknownParserError(LookupError):
    """No parser is registered under that name."""


@dataclass(frozen=True, slots=True)
class _ToolEntry:
    factory: ToolParserFactory
    detect: TemplateDetector | None


@dataclass(frozen=True, slots=True)
class _ReasoningEntry:
    factory: ReasoningFactory
    markers: tuple[str, str]
    detect: TemplateDetector | None


_TOOL_PARSERS: dict[str, _ToolEntry] = {}
_REASONING_PARSERS: dict[str, _ReasoningEntry] = {}


def register_parser(
    name: str,
    factory: ToolParserFactory,
    *,
    detect: TemplateDetector | None = None,
    replace: bool = False,
) -> None:
    """Register a tool-call parser under `name`; `detect(template_text)` (optional)
    lets `parser_for_template` choose it. Re-registering a name needs `replace=True`."""
    if name in _TOOL_PARSERS and not replace:
        raise ValueError(f"tool parser {name!r} is already registered")
    _TOOL_PARSERS.pop(name, None)
    _TOOL_PARSERS[name] = _ToolEntry(factory, detect)


def register_reasoning_parser(
    name: str,
    factory: ReasoningFactory,
    *,
    markers: tuple[str, str],
    detect: TemplateDetector | None = None,
    replace: bool = False,
) -> None:
    """Register a reasoning splitter under `name`. `markers` (start, end) are what a
    rendered prompt is checked for to decide `starts_in_reasoning`."""
    if name in _REASONING_PARSERS and not replace:
        raise ValueError(f"reasoning parser {name!r} is already registered")
    _REASONING_PARSERS.pop(name, None)
    _REASONING_PARSERS[name] = _ReasoningEntry(factory, markers, detect)


def tool_parser_names() -> list[str]:
    return list(_TOOL_PARSERS)


def reasoning_markers(name: str) -> tuple[str, str]:
    """The (start, end) markers of reasoning parser `name`."""
    entry = _REASONING_PARSERS.get(name)
    if entry is None:
        _unknown("reasoning", name, reasoning_parser_names())
    return entry.markers


def reasoning_parser_names() -> list[str]:
    return list(_REASONING_PARSERS)


def _unknown(kind: str, name: str, known: list[str]) -> NoReturn:
    raise UnknownParserError(f"no {kind} parser {name!r}; known: {', '.join(known)}")


def get_parser(
    name: str = PLAIN,
    *,
    reasoning: str | None = None,
    starts_in_reasoning: bool | None = None,
    id_factory: IdFactory | None = None,
) -> OutputParser:
    """A fresh parser for one completion: tool parser `name`, behind reasoning splitter
    `reasoning` when given. `id_factory` makes tool-call ids (default: random)."""
    tool_entry = _TOOL_PARSERS.get(name)
    if tool_entry is None:
        _unknown("tool", name, tool_parser_names())
    tools = tool_entry.factory(id_factory=id_factory)
    if reasoning is None:
        if starts_in_reasoning is not None:
            raise ValueError("starts_in_reasoning needs a reasoning parser")
        return tools
    reasoning_entry = _REASONING_PARSERS.get(reasoning)
    if reasoning_entry is None:
        _unknown("reasoning", reasoning, reasoning_parser_names())
    splitter = reasoning_entry.factory(starts_in_reasoning=starts_in_reasoning)
    return ReasoningOutputParser(splitter, tools)


@dataclass(frozen=True, slots=True)
class ParserSpec:
    """Which parsers a model needs; `build` makes a fresh parser per completion."""

    tool: str = PLAIN
    reasoning: str | None = None
    starts_in_reasoning: bool | None = None
    notes: tuple[str, ...] = ()

    def build(self, *, id_factory: IdFactory | None = None) -> OutputParser:
        return get_parser(
            self.tool,
            reasoning=self.reasoning,
            starts_in_reasoning=self.starts_in_reasoning,
            id_factory=id_factory,
        )


def _raise_template_error(message: str) -> NoReturn:
    raise ValueError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def render_generation_prompt(template_text: str) -> str | None:
    """The template rendered for one user message with the generation prompt and
    thinking enabled, as Hugging Face renders chat templates; None if it cannot be."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: date(2024, 1, 1).strftime(fmt)
    try:
        return env.from_string(template_text).render(
            messages=_PROBE_MESSAGES,
            add_generation_prompt=True,
            enable_thinking=True,
            bos_token="",
            eos_token="",
            tools=None,
        )
    except (TemplateError, ValueError, TypeError, KeyError, AttributeError, IndexError):
        return None


def template_opens_reasoning(template_text: str, markers: tuple[str, str]) -> bool | None:
    """Whether the template's generation prompt leaves a reasoning block open (the
    completion then starts inside reasoning); None if the template cannot be rendered."""
    rendered = render_generation_prompt(template_text)
    if rendered is None:
        return None
    return prompt_ends_in_reasoning(rendered, *markers)


def parser_for_template(template_text: str) -> ParserSpec:
    """Pick the parsers a chat template's model needs, from the template's text."""
    notes: list[str] = []
    tool = next(
        (
            name
            for name, entry in reversed(_TOOL_PARSERS.items())
            if entry.detect is not None and entry.detect(template_text)
        ),
        PLAIN,
    )
    if tool == PLAIN:
        notes.extend(
            f"{what} are not parsed; they stay in content"
            for marker, what in UNSUPPORTED_TOOL_MARKERS.items()
            if marker in template_text
        )
    reasoning = next(
        (
            name
            for name, entry in reversed(_REASONING_PARSERS.items())
            if entry.detect is not None and entry.detect(template_text)
        ),
        None,
    )
    starts: bool | None = None
    if reasoning is not None:
        starts = template_opens_reasoning(template_text, _REASONING_PARSERS[reasoning].markers)
        if starts is None:
            notes.append("the template could not be rendered; starts_in_reasoning left default")
    return ParserSpec(tool, reasoning, starts, tuple(notes))


def _think(default: bool, start: str, end: str) -> ReasoningFactory:
    def factory(*, starts_in_reasoning: bool | None = None) -> ReasoningSplitter:
        starts = default if starts_in_reasoning is None else starts_in_reasoning
        return ThinkSplitter(starts_in_reasoning=starts, start=start, end=end)

    return factory


def _has(marker: str) -> TemplateDetector:
    return lambda template: marker in template


register_parser(PLAIN, PlainParser)
register_parser(
    "llama3_json",
    Llama3JsonParser,
    detect=lambda t: LLAMA_PYTHON_TAG in t or LLAMA3_HEADER in t,
)
register_parser("mistral", MistralParser, detect=_has(MISTRAL_TOOL_CALLS))
register_parser(
    "hermes",
    HermesParser,
    detect=lambda t: (
        HERMES_CALL_START in t and not any(marker in t for marker in UNSUPPORTED_TOOL_MARKERS)
    ),
)
register_reasoning_parser(
    "deepseek_r1", _think(True, THINK_START, THINK_END), markers=(THINK_START, THINK_END)
)
register_reasoning_parser(
    "qwen3",
    _think(False, THINK_START, THINK_END),
    markers=(THINK_START, THINK_END),
    detect=_has(THINK_START),
)
register_reasoning_parser(
    "mistral",
    _think(False, MISTRAL_THINK_START, MISTRAL_THINK_END),
    markers=(MISTRAL_THINK_START, MISTRAL_THINK_END),
    detect=_has(MISTRAL_THINK_START),
)
