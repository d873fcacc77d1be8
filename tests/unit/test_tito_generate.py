"""`turnstile.tito.generate`: chat requests onto vLLM's token-in route, and its answers back."""

from __future__ import annotations

from typing import Any

import pytest

from turnstile.errors import Unprocessable
from turnstile.tito.convert import ChatAnswer, ChatStream
from turnstile.tito.generate import as_completion, generate_body, image_urls
from turnstile.tito.parsers import get_parser
from turnstile.tito.parsers.registry import PLAIN

A, B = "data:image/png;base64,AAAA", "https://example.test/b.png"


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [], **fields}


def test_image_urls_are_every_image_part_in_order() -> None:
    messages = [
        {"role": "system", "content": "s"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "x"},
                {"type": "image_url", "image_url": {"url": A}},
            ],
        },
        {"role": "assistant", "content": None},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": B},
                {"type": "image_url", "image_url": {"url": A}},
            ],
        },
        "not a message",
    ]
    assert image_urls(messages) == [A, B, A]
    assert image_urls([{"role": "user", "content": "text"}]) == []


def test_generate_body_maps_the_sampling_fields() -> None:
    chat = _chat(
        temperature=0.5,
        top_p=0.9,
        seed=7,
        stop=["\n"],
        max_completion_tokens=12,
        max_tokens=99,
        stream=True,
        stream_options={"include_usage": True},
        priority=3,
        logit_bias={"42": -100},
        user="ignored",
    )
    body = generate_body(chat, [1, 2, 3], [A, B], top_k=2)
    assert body["token_ids"] == [1, 2, 3]
    assert body["content_parts"] == [
        {"type": "image_url", "url": A},
        {"type": "image_url", "url": B},
    ]
    assert body["sampling_params"] == {
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 7,
        "stop": ["\n"],
        "max_tokens": 12,  # max_completion_tokens wins, as on the chat route
        "logprobs": 2,
        "logit_bias": {42: -100.0},
    }
    assert body["return_token_ids"] is True and body["output_mode"] == "text"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "m" and body["priority"] == 3
    assert "user" not in body


def test_generate_body_leaves_max_tokens_to_the_server() -> None:
    body = generate_body(_chat(), [1], [A], top_k=0)
    assert "max_tokens" not in body["sampling_params"]  # not the route's default of 16
    assert body["sampling_params"]["logprobs"] == 0 and body["stream"] is False


@pytest.mark.parametrize(
    ("response_format", "expected"),
    [
        ({"type": "json_object"}, {"json_object": True}),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
            {"json": {"type": "object"}},
        ),
        ({"type": "text"}, None),
    ],
)
def test_response_format_becomes_structured_outputs(
    response_format: dict[str, Any], expected: dict[str, Any] | None
) -> None:
    body = generate_body(_chat(response_format=response_format), [1], [A], top_k=0)
    assert body["sampling_params"].get("structured_outputs") == expected


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "grammar"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"truncate_prompt_tokens": 10}, "truncate_prompt_tokens"),
    ],
)
def test_what_the_route_cannot_take_is_422(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(Unprocessable) as err:
        generate_body(_chat(**fields), [1], [A], top_k=0)
    assert err.value.param == param


def _entry(token_id: int, logprob: float) -> dict[str, Any]:
    top = [{"token": f"t{token_id}", "logprob": logprob}, {"token": "alt", "logprob": -9.0}]
    return {"token": f"t{token_id}", "logprob": logprob, "bytes": None, "top_logprobs": top}


def test_a_whole_answer_becomes_a_chat_answer_with_the_expanded_prompt() -> None:
    answer = {
        "model": "m",
        "prompt_token_ids": [5, 9, 9, 9, 6],
        "mm_placeholders": {"image": [{"offset": 1, "length": 3}]},
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
        "choices": [
            {
                "index": 0,
                "text": "hi",
                "token_ids": [11, 12],
                "finish_reason": "stop",
                "stop_reason": 151645,
                "logprobs": {"content": [_entry(11, -0.5), _entry(12, -0.25)]},
            }
        ],
    }
    chat, _ = ChatAnswer(get_parser(PLAIN), 1).convert(as_completion(answer))
    assert chat["prompt_token_ids"] == [5, 9, 9, 9, 6]
    choice = chat["choices"][0]
    assert choice["message"]["content"] == "hi" and choice["token_ids"] == [11, 12]
    assert choice["stop_reason"] == 151645 and choice["finish_reason"] == "stop"
    content = choice["logprobs"]["content"]
    assert [e["logprob"] for e in content] == [-0.5, -0.25]
    assert [len(e["top_logprobs"]) for e in content] == [1, 1]  # cut to top_logprobs


def test_stream_chunks_become_chat_chunks_with_the_prompt_on_the_first() -> None:
    stream = ChatStream(get_parser(PLAIN), 0)
    chunks = [
        {
            "prompt_token_ids": [5, 9, 9, 6],
            "choices": [
                {
                    "index": 0,
                    "text": "h",
                    "token_ids": [11],
                    "finish_reason": None,
                    "logprobs": {"content": [_entry(11, -0.5)]},
                }
            ],
        },
        {
            "choices": [
                {
                    "index": 0,
                    "text": "i",
                    "token_ids": [12],
                    "finish_reason": "length",
                    "logprobs": {"content": [_entry(12, -0.25)]},
                }
            ],
        },
        {"usage": {"prompt_tokens": 4, "completion_tokens": 2}, "choices": []},
    ]
    out = [c for chunk in chunks for c in stream.convert(as_completion(chunk))]
    assert out[0]["prompt_token_ids"] == [5, 9, 9, 6]
    assert stream.prompt_ids == [5, 9, 9, 6] and stream.token_ids == [11, 12]
    assert stream.finish == "length"
    assert (
        "".join(c["choices"][0]["delta"].get("content") or "" for c in out if c["choices"]) == "hi"
    )
    assert out[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 2}
    assert out[1]["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


def test_as_completion_leaves_other_values_alone() -> None:
    assert as_completion([1]) == [1]
    error = {"error": {"message": "x"}}
    assert as_completion(dict(error)) == error
