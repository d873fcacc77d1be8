"""Completion-text parsers (turnstile.tito.parsers): every format whole and streamed, the
chunking invariance of streams, malformed calls kept as content, and the registry."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnstile.tito.parsers import (
    HermesParser,
    OutputParser,
    ParsedDelta,
    ParsedMessage,
    ParserSpec,
    ThinkSplitter,
    ToolCall,
    ToolParser,
    UnknownParserError,
    Utf8Feeder,
    finish_reason,
    get_parser,
    parser_for_template,
    prompt_ends_in_reasoning,
    register_parser,
    registry,
)
from turnstile.tito.parsers.reasoning import ReasoningOutputParser
from turnstile.tito.parsers.tools import PlainParser

PROPERTY_EXAMPLES = 100


def counter_ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def build(
    name: str, reasoning: str | None = None, starts_in_reasoning: bool | None = None
) -> OutputParser:
    return get_parser(
        name,
        reasoning=reasoning,
        starts_in_reasoning=starts_in_reasoning,
        id_factory=counter_ids(),
    )


def whole(
    name: str, text: str, reasoning: str | None = None, starts_in_reasoning: bool | None = None
) -> ParsedMessage:
    return build(name, reasoning, starts_in_reasoning).parse(text)


def stream(
    name: str, pieces: list[str], reasoning: str | None = None
) -> tuple[ParsedMessage, list[ParsedDelta]]:
    parser = build(name, reasoning)
    deltas = [parser.feed(piece) for piece in pieces]
    deltas.append(parser.finish())
    return ParsedMessage.from_deltas(deltas), deltas


def chars(text: str) -> list[str]:
    return list(text)


def cut(text: str, points: list[int]) -> list[str]:
    bounds = [0, *sorted(set(points)), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def calls(message: ParsedMessage) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in message.tool_calls]


def hermes_call(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


# --- hermes ---------------------------------------------------------------------------


def test_hermes_single_call_with_content_before() -> None:
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    message = whole("hermes", text)
    assert message.content == "Let me check."
    assert message.reasoning is None
    assert message.tool_calls == [ToolCall("call_0", "get_weather", '{"city": "Paris"}')]
    assert message.errors == []


def test_hermes_arguments_reserialised_like_vllm() -> None:
    # vLLM's hermes parser: json.dumps(call["arguments"], ensure_ascii=False).
    body = '{ "arguments" :{"b" :2,"a":  [1, {"x":null}], "s": "\\u00e9 東京 \\n"} , "name":"f" }'
    message = whole("hermes", hermes_call(body))
    expected = json.dumps(json.loads(body)["arguments"], ensure_ascii=False)
    assert calls(message) == [("f", expected)]
    assert expected == '{"b": 2, "a": [1, {"x": null}], "s": "é 東京 \\n"}'


def test_hermes_parallel_calls_streamed_in_openai_shape() -> None:
    text = (
        "Checking both.\n"
        + hermes_call('{"name": "a", "arguments": {"x": 1}}')
        + "\n"
        + hermes_call('{"name": "b", "arguments": {}}')
        + "\n"
        + hermes_call('{"name": "c"}')
        + "\n"
    )
    message, deltas = stream("hermes", chars(text))
    assert message.content == "Checking both."
    assert calls(message) == [("a", '{"x": 1}'), ("b", "{}"), ("c", "{}")]
    pieces = [piece.to_openai() for delta in deltas for piece in delta.tool_calls]
    assert pieces == [
        {
            "index": i,
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": name, "arguments": args},
        }
        for i, (name, args) in enumerate(calls(message))
    ]
    assert message == whole("hermes", text)


def test_hermes_malformed_json_stays_content_verbatim() -> None:
    bad = "Hi\n<tool_call>\n{name: oops}\n</tool_call>"
    good = hermes_call('{"name": "f", "arguments": {"k": "v"}}')
    message = whole("hermes", bad + "\n" + good)
    assert message.content == bad
    assert calls(message) == [("f", '{"k": "v"}')]
    assert message.tool_calls[0].id == "call_0"
    assert len(message.errors) == 1 and "invalid JSON" in message.errors[0]


@pytest.mark.parametrize(
    "body",
    [
        '{"arguments": {}}',  # no name
        '{"name": "", "arguments": {}}',
        '{"name": "f", "arguments": [1, 2]}',
        '{"name": "f", "arguments": "not json"}',
        '["f", {}]',
    ],
)
def test_hermes_wrong_shapes_stay_content(body: str) -> None:
    text = hermes_call(body)
    message = whole("hermes", text)
    assert message.content == text
    assert message.tool_calls == []
    assert len(message.errors) == 1


def test_hermes_string_arguments_holding_json_are_unwrapped() -> None:
    message = whole("hermes", hermes_call('{"name": "f", "arguments": "{\\"a\\": 1}"}'))
    assert calls(message) == [("f", '{"a": 1}')]


def test_hermes_unterminated_call() -> None:
    # A body that is a whole call counts even without the closing tag (vLLM does too).
    done = whole("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_')
    assert calls(done) == [("f", '{"a": 1}')] and done.content is None
    cut_off = '<tool_call>\n{"name": "f", "argu'
    truncated = whole("hermes", cut_off)
    assert truncated.content == cut_off and truncated.tool_calls == []
    assert "unterminated" in truncated.errors[0]


def test_hermes_text_between_and_after_calls() -> None:
    text = (
        "  Before.  \n"
        + hermes_call('{"name": "a", "arguments": {}}')
        + "\nBetween.\n"
        + hermes_call('{"name": "b", "arguments": {}}')
        + "\n\nAfter."
    )
    message = whole("hermes", text)
    assert message.content == "  Before.\nBetween.\n\nAfter."
    assert calls(message) == [("a", "{}"), ("b", "{}")]


def test_hermes_text_that_is_no_call_is_verbatim() -> None:
    text = "Use <tool_call> tags\nlike <tool_cal or </tool_call> \n\n"
    message = whole("hermes", text)
    assert message.content == text
    assert message.tool_calls == []
    assert len(message.errors) == 1  # the tagged span is no JSON call
    mention = "Write <tool_cal and <tool_call without the closing bracket.\n"
    assert whole("hermes", mention) == ParsedMessage(content=mention)


def test_hermes_holds_back_only_a_possible_marker() -> None:
    parser = build("hermes")
    assert parser.feed("Hello").content == "Hello"
    assert parser.feed(" <tool").content == ""  # might be the start of <tool_call>
    assert parser.feed("box> is").content == " <toolbox> is"
    assert parser.feed(" <").content == ""
    held = parser.feed("tool_call>")
    assert held.content == "" and held.tool_calls == []
    assert parser.feed('{"name": "f", "arguments": {}}').tool_calls == []
    closed = parser.feed("</tool_call>")
    assert [piece.name for piece in closed.tool_calls] == ["f"]
    assert parser.finish().is_empty()


# --- reasoning -----------------------------------------------------------------------


def test_qwen3_reasoning_then_tool_call() -> None:
    text = "<think>\nThe user wants weather.\n</think>\n\n" + hermes_call(
        '{"name": "get_weather", "arguments": {"city": "東京"}}'
    )
    for message in (
        whole("hermes", text, "qwen3"),
        stream("hermes", chars(text), reasoning="qwen3")[0],
    ):
        assert message.reasoning == "\nThe user wants weather.\n"
        assert message.content is None
        assert calls(message) == [("get_weather", '{"city": "東京"}')]


def test_qwen3_reasoning_and_content_kept_verbatim_like_vllm() -> None:
    message = whole("plain", "<think>\nhmm\n</think>\n\nThe answer is 4.", reasoning="qwen3")
    assert message.reasoning == "\nhmm\n"
    assert message.content == "\n\nThe answer is 4."


def test_qwen3_without_think_is_all_content() -> None:
    text = "No thinking here </think> at all."
    assert whole("plain", text, reasoning="qwen3").content == text
    assert whole("plain", text, reasoning="qwen3").reasoning is None


def test_truncated_reasoning_is_all_reasoning() -> None:
    message = whole("hermes", "<think>\nstill thinking <tool_call>", reasoning="qwen3")
    assert message.reasoning == "\nstill thinking <tool_call>"
    assert message.content is None and message.tool_calls == []


def test_r1_starts_in_reasoning() -> None:
    text = "The prompt opened the block.\n</think>\n\nDone."
    message = whole("plain", text, reasoning="deepseek_r1")
    assert message.reasoning == "The prompt opened the block.\n"
    assert message.content == "\n\nDone."
    # The same text through qwen3 (model writes <think> itself) is all content...
    assert whole("plain", text, reasoning="qwen3").content == text
    # ...unless the flag says the prompt opened the block.
    flagged = whole("plain", text, reasoning="qwen3", starts_in_reasoning=True)
    assert flagged.reasoning == "The prompt opened the block.\n"


def test_r1_repeated_think_at_start_is_dropped() -> None:
    message = whole("plain", "<think>\nx</think>y", reasoning="deepseek_r1")
    assert (message.reasoning, message.content) == ("\nx", "y")


def test_reasoning_end_marker_split_across_pieces() -> None:
    parser = build("plain", reasoning="qwen3")
    assert parser.feed("<thi").is_empty()
    assert parser.feed("nk>abc</").reasoning == "abc"
    assert parser.feed("b> more </th").reasoning == "</b> more "
    delta = parser.feed("ink>rest")
    assert (delta.reasoning, delta.content) == ("", "rest")


def test_mistral_think_markers() -> None:
    text = "[THINK]Let me see.[/THINK]It is 4."
    for name in ("mistral", "plain"):
        message = whole(name, text, reasoning="mistral")
        assert (message.reasoning, message.content) == ("Let me see.", "It is 4.")


MULTIBYTE_START, MULTIBYTE_END = "<思考>", "</思考>"


def test_multibyte_markers_split_mid_marker() -> None:
    text = f"{MULTIBYTE_START}推理 é{MULTIBYTE_END}答え"
    for pieces in ([text], chars(text)):
        splitter = ThinkSplitter(start=MULTIBYTE_START, end=MULTIBYTE_END)
        parts = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
        assert "".join(r for r, _ in parts) == "推理 é"
        assert "".join(c for _, c in parts) == "答え"


def test_utf8_bytes_split_mid_character() -> None:
    text = f"{MULTIBYTE_START}考え中{MULTIBYTE_END}東京" + hermes_call(
        '{"name": "天気", "arguments": {"都市": "東京"}}'
    )
    data = text.encode()
    for size in (1, 2, 5):
        inner = ThinkSplitter(start=MULTIBYTE_START, end=MULTIBYTE_END)
        feeder = Utf8Feeder(ReasoningOutputParser(inner, HermesParser(id_factory=counter_ids())))
        deltas = [feeder.feed(data[i : i + size]) for i in range(0, len(data), size)]
        deltas.append(feeder.finish())
        message = ParsedMessage.from_deltas(deltas)
        assert (message.reasoning, message.content) == ("考え中", "東京")
        assert calls(message) == [("天気", '{"都市": "東京"}')]
    truncated = Utf8Feeder(get_parser("plain"))
    assert truncated.feed("é".encode()[:1]).is_empty()
    assert truncated.finish().content == "\ufffd"


def test_prompt_ends_in_reasoning() -> None:
    assert prompt_ends_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_ends_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_ends_in_reasoning("<|im_start|>assistant\n")
    assert prompt_ends_in_reasoning("[THINK]a[/THINK] x [THINK]", "[THINK]", "[/THINK]")


# --- llama3_json ------------------------------------------------------------------------


def test_llama_calls_with_python_tag_and_separators() -> None:
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich"}}; '
        '{"parameters": {}, "name": "now"} ;{"name": "x", "arguments": {"a": [1]}}'
    )
    message = whole("llama3_json", text)
    assert message.content is None and message.errors == []
    assert calls(message) == [
        ("get_weather", '{"city": "Zürich"}'),
        ("now", "{}"),
        ("x", '{"a": [1]}'),
    ]


def test_llama_untagged_call_and_trailing_text() -> None:
    message = whole("llama3_json", '\n{"name": "f", "parameters": {"q": "a;b{c}"}}\n')
    assert calls(message) == [("f", '{"q": "a;b{c}"}')] and message.content is None
    after = whole("llama3_json", '{"name": "f", "parameters": {}}\nCalled it.')
    assert calls(after) == [("f", "{}")] and after.content == "\nCalled it."


def test_llama_plain_and_json_answers_are_content() -> None:
    parser = build("llama3_json")
    assert parser.feed("Hello there").content == "Hello there"  # decided at once
    answer = '{"answer": 42, "items": [1, 2]}'
    message = whole("llama3_json", answer)
    assert message.content == answer and message.tool_calls == [] and message.errors == []
    # An object with a name but no arguments key is an answer, not a call.
    person = '{"name": "Ada", "born": 1815}'
    assert whole("llama3_json", person).content == person
    assert whole("llama3_json", person).tool_calls == []


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "f", "parameters": {"x": 1}',  # unterminated
        '{"name": "f", parameters: {}}',  # invalid JSON
        "<|python_tag|>brave_search.call(query='x')",  # built-in tool syntax
        '<|python_tag|>{"parameters": {}}',
    ],
)
def test_llama_malformed_stays_content(text: str) -> None:
    for message in (whole("llama3_json", text), stream("llama3_json", chars(text))[0]):
        assert message.content == text
        assert message.tool_calls == []
        assert len(message.errors) == 1


def test_llama_second_call_malformed_keeps_first() -> None:
    message = whole("llama3_json", '{"name": "f", "parameters": {}}; {"name": oops}')
    assert calls(message) == [("f", "{}")]
    assert message.content == '; {"name": oops}'
    assert len(message.errors) == 1


# --- mistral ---------------------------------------------------------------------------


def test_mistral_list_form() -> None:
    text = (
        'Sure.[TOOL_CALLS] [{"name": "f", "arguments": {"a": "ß"}, "id": "abcDEF123"}, '
        '{"arguments": {"b": 2}, "name": "g"}]'
    )
    message = whole("mistral", text)
    assert message.content == "Sure."
    assert calls(message) == [("f", '{"a": "ß"}'), ("g", '{"b": 2}')]
    assert message.tool_calls[0].id == "abcDEF123"  # the model's own id is kept


def test_mistral_v11_form_passes_arguments_verbatim() -> None:
    text = (
        '[TOOL_CALLS]get_weather[ARGS]{"city":  "Paris" }[TOOL_CALLS]now[CALL_ID]Xy12345ab[ARGS]{}'
    )
    message = whole("mistral", text)
    assert calls(message) == [("get_weather", '{"city":  "Paris" }'), ("now", "{}")]
    assert message.tool_calls[1].id == "Xy12345ab"
    # Without [ARGS] (special tokens skipped by the detokenizer), as vLLM accepts too.
    assert calls(whole("mistral", '[TOOL_CALLS]f{"a": 1}')) == [("f", '{"a": 1}')]


def test_mistral_default_ids_fit_mistral_templates() -> None:
    message = get_parser("mistral").parse("[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g[ARGS]{}")
    ids = [call.id for call in message.tool_calls]
    assert all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids)
    assert len(set(ids)) == 2


@pytest.mark.parametrize(
    "text",
    [
        "[TOOL_CALLS]",
        "[TOOL_CALLS] not a call at all",
        '[TOOL_CALLS][{"name": "f", "arguments": {}]',
        "[TOOL_CALLS][]",
        '[TOOL_CALLS]f[ARGS]{"a": }',
        "[TOOL_CALLS]f[ARGS][1, 2]",
        '[TOOL_CALLS]f[ARGS]{"a": 1',
    ],
)
def test_mistral_malformed_stays_content(text: str) -> None:
    for message in (whole("mistral", text), stream("mistral", chars(text))[0]):
        assert message.content == text
        assert message.tool_calls == []
        assert len(message.errors) == 1


def test_mistral_reasoning_then_calls() -> None:
    text = '[THINK]need weather[/THINK][TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}'
    message = whole("mistral", text, reasoning="mistral")
    assert message.reasoning == "need weather"
    assert message.content is None
    assert calls(message) == [("get_weather", '{"city": "Lyon"}')]


# --- plain, messages, finish reasons ----------------------------------------------------


def test_plain_passes_everything_through() -> None:
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>[TOOL_CALLS]'
    parser = build("plain")
    assert parser.feed(text).content == text
    assert whole("plain", "").content is None


def test_message_and_delta_openai_shapes() -> None:
    text = "<think>r</think>c" + hermes_call('{"name": "f", "arguments": {}}')
    message = whole("hermes", text, "qwen3")
    call = {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert message.to_openai() == {
        "role": "assistant",
        "content": "c",
        "reasoning": "r",
        "tool_calls": [call],
    }
    assert message.to_openai("reasoning_content")["reasoning_content"] == "r"
    both = message.to_openai("both")
    assert both["reasoning"] == both["reasoning_content"] == "r"
    assert ParsedDelta(reasoning="r").to_openai("both") == {
        "reasoning": "r",
        "reasoning_content": "r",
    }
    assert whole("plain", "hi").to_openai() == {"role": "assistant", "content": "hi"}


def test_finish_reason() -> None:
    with_calls = whole("hermes", hermes_call('{"name": "f", "arguments": {}}'))
    without = whole("hermes", "hello")
    assert finish_reason("stop", with_calls) == "tool_calls"
    assert finish_reason("length", with_calls) == "length"
    assert finish_reason("stop", without) == "stop"
    assert finish_reason(None, with_calls) is None
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason("stop", False) == "stop"


def test_parser_lifecycle() -> None:
    parser = build("hermes")
    assert isinstance(parser, OutputParser)
    parser.feed("x")
    with pytest.raises(RuntimeError):
        parser.parse("y")
    parser.finish()
    assert parser.finish().is_empty()
    with pytest.raises(RuntimeError):
        parser.feed("z")


# --- registry ------------------------------------------------------------------------


def test_get_parser_builds_by_name() -> None:
    assert isinstance(get_parser("hermes"), HermesParser)
    assert isinstance(get_parser("hermes", reasoning="qwen3"), ReasoningOutputParser)
    with pytest.raises(UnknownParserError, match="hermes"):
        get_parser("nope")
    with pytest.raises(UnknownParserError):
        get_parser("hermes", reasoning="nope")
    with pytest.raises(ValueError, match="reasoning parser"):
        get_parser("hermes", starts_in_reasoning=True)


class _AngleParser(ToolParser):
    """A plug-in format for the test: `<<name>>` is a call without arguments."""

    name = "angle"

    def _feed(self, text: str) -> ParsedDelta:
        self._buf += text
        out = ParsedDelta()
        while "<<" in self._buf and ">>" in self._buf:
            before, _, rest = self._buf.partition("<<")
            name, _, self._buf = rest.partition(">>")
            self._content(out, before)
            self._call(out, name, "{}", None)
        return out

    def _finish(self) -> ParsedDelta:
        return ParsedDelta(content=self._buf)


def test_register_parser_plug_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_TOOL_PARSERS", dict(registry._TOOL_PARSERS))
    register_parser("angle", _AngleParser, detect=lambda t: "<<" in t)
    with pytest.raises(ValueError, match="already registered"):
        register_parser("angle", _AngleParser)
    spec = parser_for_template("{{ '<<' + name + '>>' }} <tool_call>")
    assert spec == ParserSpec("angle")  # newest registration is asked first
    message = spec.build(id_factory=counter_ids()).parse("a<<f>>b")
    assert (message.content, calls(message)) == ("ab", [("f", "{}")])
    register_parser("angle", PlainParser, replace=True)
    assert isinstance(get_parser("angle"), PlainParser)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ '<tool_call>' }}", ParserSpec("hermes")),
        ("{{ '<|start_header_id|>' }}", ParserSpec("llama3_json")),
        ("{{ '<|python_tag|>' }}", ParserSpec("llama3_json")),
        ("{{ '[TOOL_CALLS]' }}", ParserSpec("mistral")),
        ("plain text", ParserSpec()),
        (
            "{% if add_generation_prompt %}<think>\n{% endif %}",
            ParserSpec("plain", "qwen3", True),
        ),
        ("{{ '<think>' }}{{ '</think>' }}", ParserSpec("plain", "qwen3", False)),
    ],
)
def test_parser_for_template_markers(template: str, expected: ParserSpec) -> None:
    assert parser_for_template(template) == expected


def test_parser_for_template_notes_unsupported_formats() -> None:
    spec = parser_for_template("<tool_call>\n<function=name>\n{% if x %}{% endif %}")
    assert spec.tool == "plain" and "Qwen3-Coder" in spec.notes[0]
    broken = parser_for_template("<think>{{ raise_exception('no') }}")
    assert broken.reasoning == "qwen3" and broken.starts_in_reasoning is None
    assert broken.notes


# --- properties: any split of the text streams to the whole-text parse ----------------

PARSER_CONFIGS: list[tuple[str, str | None]] = [
    ("plain", None),
    ("hermes", None),
    ("llama3_json", None),
    ("mistral", None),
    ("hermes", "qwen3"),
    ("plain", "deepseek_r1"),
    ("mistral", "mistral"),
]
CONFIG_IDS = [f"{name}+{reasoning}" for name, reasoning in PARSER_CONFIGS]

ARG_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text('aé東"\\{}[];<> \n', max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text("ab", max_size=2), inner, max_size=3)
    ),
    max_leaves=6,
)
ARGS = st.dictionaries(st.text("xyé", min_size=1, max_size=3), ARG_VALUES, max_size=3)
NAMES = st.sampled_from(["f", "get_weather", "do-it"])
SPACING = st.sampled_from([None, 0, 2])


@st.composite
def call_texts(draw: st.DrawFn) -> str:
    name, args = draw(NAMES), draw(ARGS)
    indent, ascii_only = draw(SPACING), draw(st.booleans())

    def dump(value: object) -> str:
        return json.dumps(value, indent=indent, ensure_ascii=ascii_only)

    form = draw(st.sampled_from(["hermes", "llama", "mistral_list", "mistral_v11"]))
    if form == "hermes":
        return hermes_call(dump({"name": name, "arguments": args}))
    if form == "llama":
        return draw(st.sampled_from(["", "<|python_tag|>"])) + dump(
            {"name": name, "parameters": args}
        )
    if form == "mistral_list":
        return "[TOOL_CALLS]" + dump([{"name": name, "arguments": args}])
    return f"[TOOL_CALLS]{name}[ARGS]" + dump(args)


FRAGMENTS = st.one_of(
    st.text('ab <>/{}[];"é東\n\t|_', max_size=8),
    st.sampled_from(
        [
            "<think>",
            "</think>",
            "<thi",
            "</th",
            "[THINK]",
            "[/THINK]",
            "<tool_call>",
            "</tool_call>",
            "<tool_",
            "</tool_c",
            "[TOOL_CALLS]",
            "[TOOL_",
            "[ARGS]",
            "[CALL_ID]abc123XYZ",
            "<|python_tag|>",
            ";",
            "\n\n",
            "{",
            "}",
            '{"name": ',
            '"arguments": {',
            "<tool_call>{broken</tool_call>",
            '<tool_call>\n{"name": "f"',
        ]
    ),
    call_texts(),
)
TEXTS = st.lists(FRAGMENTS, max_size=8).map("".join)


@pytest.mark.parametrize(("name", "reasoning"), PARSER_CONFIGS, ids=CONFIG_IDS)
@settings(
    max_examples=PROPERTY_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(data=st.data())
def test_any_split_streams_to_the_whole_parse(
    name: str, reasoning: str | None, data: st.DataObject
) -> None:
    opening = data.draw(st.sampled_from(["", "<think>", " \n<think>\n", "[THINK]"]))
    text = opening + data.draw(TEXTS, label="text")
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=12), label="cuts")
    expected = whole(name, text, reasoning)
    assert stream(name, cut(text, points), reasoning)[0] == expected
    assert stream(name, chars(text), reasoning)[0] == expected


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
@settings(max_examples=PROPERTY_EXAMPLES, deadline=None)
@given(text=TEXTS)
def test_no_calls_means_content_is_the_text(name: str, text: str) -> None:
    message = whole(name, text)
    if not message.tool_calls:
        assert message.content == (text or None)


Body = tuple[str, dict[str, object], int | None]


def render_calls(form: str, before: str, bodies: list[Body]) -> str:
    """Calls as each model family writes them (json.dumps with assorted spacing)."""
    if form == "hermes":
        return before + "".join(
            "\n" + hermes_call(json.dumps({"name": n, "arguments": a}, indent=i))
            for n, a, i in bodies
        )
    if form == "llama3_json":
        return "<|python_tag|>" + "; ".join(
            json.dumps({"name": n, "parameters": a}, indent=i) for n, a, i in bodies
        )
    if form == "mistral_list":
        items = [{"name": n, "arguments": a} for n, a, _ in bodies]
        return before + "[TOOL_CALLS]" + json.dumps(items, indent=bodies[0][2])
    return before + "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a, indent=i)}" for n, a, i in bodies)


FORM_PARSERS = {
    "hermes": "hermes",
    "llama3_json": "llama3_json",
    "mistral_list": "mistral",
    "mistral_v11": "mistral",
}


@pytest.mark.parametrize("form", list(FORM_PARSERS))
@settings(max_examples=PROPERTY_EXAMPLES, deadline=None)
@given(
    before=st.text("ab é東\n", max_size=6),
    bodies=st.lists(st.tuples(NAMES, ARGS, SPACING), min_size=1, max_size=3),
    data=st.data(),
)
def test_calls_roundtrip(form: str, before: str, bodies: list[Body], data: st.DataObject) -> None:
    if form == "llama3_json":
        before = ""  # Llama's calls are the whole message
    text = render_calls(form, before, bodies)
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    message, _ = stream(FORM_PARSERS[form], cut(text, points))
    if form == "mistral_v11":  # passed on verbatim, as vLLM does
        expected = [(n, json.dumps(a, indent=i)) for n, a, i in bodies]
    else:
        expected = [(n, json.dumps(a, ensure_ascii=False)) for n, a, _ in bodies]
    assert calls(message) == expected
    assert message.content == (before.rstrip() or None)
    assert message.errors == []


def test_json_strings_with_escapes_and_brackets() -> None:
    args: dict[str, object] = {"s": 'a"}{[', "t": "\\", "u": ']}"\\"'}
    for form in FORM_PARSERS:
        message = whole(FORM_PARSERS[form], render_calls(form, "", [("f", args, None)]))
        assert [json.loads(a) for _, a in calls(message)] == [args], form
