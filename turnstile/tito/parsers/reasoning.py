"""Reasoning splitters: separate a completion's thinking text from its answer.

`ThinkSplitter` handles marker-delimited reasoning as vLLM's `qwen3`, `deepseek_r1`
and `mistral` reasoning parsers see it (`<think>...</think>`, `[THINK]...[/THINK]`):

* When the prompt already opened the reasoning block (`starts_in_reasoning`, e.g. the
  DeepSeek-R1 distills, QwQ and Qwen3.5 templates end the generation prompt with
  `<think>\\n`), everything up to the end marker is reasoning; a repeated start marker
  at the very beginning is dropped.
* Otherwise (Qwen3 before 2507 writes `<think>` itself), reasoning is present only when
  the completion begins, after optional whitespace, with the start marker; any other
  completion is all content.
* No end marker (a truncated completion) leaves everything after the start as reasoning.

Texts are kept verbatim: reasoning keeps its newlines and content keeps whatever follows
the end marker, as vLLM returns them. `prompt_ends_in_reasoning` tells from a rendered
prompt whether the completion starts inside reasoning.

`ReasoningOutputParser` composes a splitter with any `OutputParser` (for tool calls),
which then sees only the content text.
"""

from __future__ import annotations

from enum import Enum, auto

from turnstile.tito.parsers.base import (
    BaseOutputParser,
    OutputParser,
    ParsedDelta,
    ReasoningSplitter,
    could_become,
    partial_marker_len,
)

THINK_START = "<think>"
THINK_END = "</think>"
MISTRAL_THINK_START = "[THINK]"
MISTRAL_THINK_END = "[/THINK]"


def prompt_ends_in_reasoning(
    prompt_text: str, start: str = THINK_START, end: str = THINK_END
) -> bool:
    """Whether a rendered prompt leaves a reasoning block open (its last `start` marker
    comes after its last `end` marker), so the completion begins inside reasoning."""
    last_start = prompt_text.rfind(start)
    return last_start >= 0 and last_start > prompt_text.rfind(end)


class _Phase(Enum):
    START = auto()  # nothing decided yet: a start marker may still come
    REASONING = auto()
    CONTENT = auto()


class ThinkSplitter:
    """Splits `start ... end` reasoning from content, holding back only text that may
    still become one of the markers."""

    __slots__ = ("_buf", "_end", "_phase", "_start", "_starts_in_reasoning")

    def __init__(
        self,
        *,
        starts_in_reasoning: bool = False,
        start: str = THINK_START,
        end: str = THINK_END,
    ) -> None:
        if not start or not end:
            raise ValueError("reasoning markers must be non-empty")
        self._start = start
        self._end = end
        self._starts_in_reasoning = starts_in_reasoning
        self._phase = _Phase.START
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            if self._phase is _Phase.START:
                stripped = self._buf.lstrip()
                if not stripped or could_become(stripped, self._start):
                    break
                if stripped.startswith(self._start):
                    self._buf = stripped[len(self._start) :]
                    self._phase = _Phase.REASONING
                else:
                    self._phase = _Phase.REASONING if self._starts_in_reasoning else _Phase.CONTENT
            elif self._phase is _Phase.REASONING:
                at = self._buf.find(self._end)
                if at >= 0:
                    reasoning.append(self._buf[:at])
                    self._buf = self._buf[at + len(self._end) :]
                    self._phase = _Phase.CONTENT
                    continue
                keep = partial_marker_len(self._buf, self._end)
                reasoning.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            else:
                content.append(self._buf)
                self._buf = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        held, self._buf = self._buf, ""
        in_reasoning = self._phase is _Phase.REASONING or (
            self._phase is _Phase.START and self._starts_in_reasoning
        )
        return (held, "") if in_reasoning else ("", held)


class ReasoningOutputParser(BaseOutputParser):
    """A reasoning splitter in front of another parser, which receives the content."""

    def __init__(self, splitter: ReasoningSplitter, inner: OutputParser) -> None:
        super().__init__()
        self._splitter = splitter
        self._inner = inner

    def _feed(self, text: str) -> ParsedDelta:
        reasoning, content = self._splitter.feed(text)
        out = ParsedDelta(reasoning=reasoning)
        if content:
            out.extend(self._inner.feed(content))
        return out

    def _finish(self) -> ParsedDelta:
        reasoning, content = self._splitter.finish()
        out = ParsedDelta(reasoning=reasoning)
        if content:
            out.extend(self._inner.feed(content))
        out.extend(self._inner.finish())
        return out
