"""The Qwen3 tokenizer built by ``turnstile.dev.devstack`` is Qwen3's real tokenizer.

Needs the tokenizer (built into the Turnstile cache on first use, which downloads the
llama-cpp-python source distribution from PyPI), but no vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from turnstile.dev import devstack

# llama.cpp's vocabularies and templates (a 76 MB download, cached); no vLLM.
pytestmark = pytest.mark.assets

TOOL_CALL, END_TOOL_CALL = 151657, 151658
TOOL_RESPONSE, END_TOOL_RESPONSE = 151665, 151666
IM_START, IM_END = 151644, 151645

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
]
# Qwen3's rendering of CONVERSATION after its tools preamble.
EXPECTED_TURNS = (
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call><|im_end|>\n"
    '<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response><|im_end|>\n'
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    return devstack.ensure_qwen3_tokenizer()


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def test_reproduces_llama_cpp_qwen2_test_vectors(tokenizer: Any) -> None:
    vocab_file = devstack.ensure_llama_cpp_assets() / "vocab" / devstack.QWEN2_VOCAB_FILE
    vectors = devstack.read_llama_cpp_test_vectors(vocab_file)
    assert len(vectors) >= 40
    for text, expected in vectors:
        assert tokenizer.encode(text, add_special_tokens=False) == expected, text


def test_added_tokens_have_qwen3_ids(tokenizer: Any) -> None:
    for token_id, content, _ in devstack.QWEN3_ADDED_TOKENS:
        assert tokenizer.convert_tokens_to_ids(content) == token_id
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert len(tokenizer) == devstack.QWEN3_ADDED_TOKENS[-1][0] + 1


def test_renders_tool_calls_in_qwen3_format(tokenizer: Any) -> None:
    text = tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\n# Tools\n\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert text.endswith(EXPECTED_TURNS)

    ids = tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tokenizer.decode(ids) == text
    for marker, token_id in [
        ("<tool_call>", TOOL_CALL),
        ("</tool_call>", END_TOOL_CALL),
        ("<tool_response>", TOOL_RESPONSE),
        ("</tool_response>", END_TOOL_RESPONSE),
        ("<|im_start|>", IM_START),
        ("<|im_end|>", IM_END),
    ]:
        assert ids.count(token_id) == text.count(marker) > 0, marker

    turns = tokenizer.encode(EXPECTED_TURNS, add_special_tokens=False)
    assert ids[-len(turns) :] == turns
    assert turns[turns.index(TOOL_CALL) - 2 : turns.index(TOOL_CALL) + 1] == [
        77091,  # "assistant"
        198,  # "\n"
        TOOL_CALL,
    ]


def test_tool_markers_survive_skip_special_tokens(tokenizer: Any) -> None:
    ids = tokenizer.encode("<tool_call>\n{}\n</tool_call><|im_end|>", add_special_tokens=False)
    assert ids[0] == TOOL_CALL and ids[-1] == IM_END
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<tool_call>\n{}\n</tool_call>"
