"""Completion text to a Chat Completions assistant message, for token-in-token-out mode.

In token-in-token-out mode Turnstile sends token IDs to the backend's `/v1/completions`
and gets back sampled tokens and their text. These parsers turn that text into what a
harness expects from `/v1/chat/completions`: `content`, `reasoning` (also available
as `reasoning_content`), `tool_calls`, and the finish reason, for whole responses and
incrementally for streams, following the formats of vLLM's reasoning and tool parsers.

Use::

    spec = parser_for_template(chat_template_text)  # e.g. qwen3 reasoning + hermes
    parser = spec.build()                            # one fresh parser per completion
    for piece in stream_texts:
        delta = parser.feed(piece)                   # ParsedDelta: emit delta.to_openai()
    delta = parser.finish()                          # whatever was held back
    # or, for a whole completion:
    message = spec.build().parse(text)               # ParsedMessage: message.to_openai()
    reason = finish_reason(backend_finish_reason, message)

Pieces that are UTF-8 bytes rather than text (a character split between tokens) go
through `Utf8Feeder(parser)`, which holds incomplete characters back.

`get_parser("hermes", reasoning="qwen3", starts_in_reasoning=...)` builds by name. When
the request's template options change whether the prompt opens a reasoning block
(`enable_thinking`), pass `starts_in_reasoning=prompt_ends_in_reasoning(prompt_text)`.

Plug-in point. A new tool-call format is any class or function that, called as
`factory(id_factory=...)`, returns a fresh `OutputParser` (`feed`, `finish`, `parse`;
subclass `ToolParser` or `BaseOutputParser` for the bookkeeping), registered with::

    register_parser("my_format", MyParser, detect=lambda template: "<my_call>" in template)

`detect` is optional; detectors are tried newest registration first, so a plug-in can
take over a template from a built-in. Reasoning formats register the same way with
`register_reasoning_parser(name, factory, markers=(start, end), detect=...)`, where the
factory takes `starts_in_reasoning` and returns a `ReasoningSplitter`; `ThinkSplitter`
with other markers covers most. Registration is process-wide; do it at import time.
"""

from turnstile.tito.parsers.base import (
    BaseOutputParser,
    IdFactory,
    OutputParser,
    ParsedDelta,
    ParsedMessage,
    ReasoningField,
    ReasoningSplitter,
    ToolCall,
    ToolCallDelta,
    Utf8Feeder,
    finish_reason,
    new_mistral_tool_call_id,
    new_tool_call_id,
)
from turnstile.tito.parsers.reasoning import (
    ReasoningOutputParser,
    ThinkSplitter,
    prompt_ends_in_reasoning,
)
from turnstile.tito.parsers.registry import (
    ParserSpec,
    ReasoningFactory,
    TemplateDetector,
    ToolParserFactory,
    UnknownParserError,
    get_parser,
    parser_for_template,
    reasoning_parser_names,
    register_parser,
    register_reasoning_parser,
    render_generation_prompt,
    template_opens_reasoning,
    tool_parser_names,
)
from turnstile.tito.parsers.tools import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    PlainParser,
    ToolParser,
)

__all__ = [
    "BaseOutputParser",
    "HermesParser",
    "IdFactory",
    "Llama3JsonParser",
    "MistralParser",
    "OutputParser",
    "ParsedDelta",
    "ParsedMessage",
    "ParserSpec",
    "PlainParser",
    "ReasoningFactory",
    "ReasoningField",
    "ReasoningOutputParser",
    "ReasoningSplitter",
    "TemplateDetector",
    "ThinkSplitter",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolParserFactory",
    "UnknownParserError",
    "Utf8Feeder",
    "finish_reason",
    "get_parser",
    "new_mistral_tool_call_id",
    "new_tool_call_id",
    "parser_for_template",
    "prompt_ends_in_reasoning",
    "reasoning_parser_names",
    "register_parser",
    "register_reasoning_parser",
    "render_generation_prompt",
    "template_opens_reasoning",
    "tool_parser_names",
]
