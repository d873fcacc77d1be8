"""Images through the Responses and Messages translators: `input_image` parts and `image`
blocks become chat `image_url` parts in their order (text-only content stays one string),
what cannot be taken is refused with a status and the field's path, and an image sent to
`/v1/responses` or `/v1/messages` is recorded once, with its span in the prompt."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from tests.fakes_backend import FakeVLLM
from tests.images import data_url, png
from turnstile.backends.fake import FAKE_IMAGE_TOKEN_ID, fake_image_tokens
from turnstile.errors import BadRequest, TurnstileError, Unprocessable
from turnstile.images import sha256_hex
from turnstile.protocols import messages, responses
from turnstile.reader import open_output
from turnstile.server.app import create_app
from turnstile.settings import load_settings

SHOT = png(56, 56, seed=5)
SHOT_URL = data_url(SHOT)
SHOT_B64 = base64.b64encode(SHOT).decode("ascii")
REMOTE = "https://example.org/shot.png"


def _no_history(_previous: str) -> list[dict[str, Any]]:
    raise AssertionError("no previous_response_id in these requests")


def responses_chat(*items: dict[str, Any]) -> list[dict[str, Any]]:
    chat, _call = responses.to_chat({"model": "m", "input": list(items)}, _no_history)
    return list(chat["messages"])


def messages_chat(*items: dict[str, Any]) -> list[dict[str, Any]]:
    chat, _call = messages.to_chat({"model": "m", "max_tokens": 8, "messages": list(items)})
    return list(chat["messages"])


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def image_url(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def input_image(url: str | None = None, **extra: Any) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "input_image", **extra}
    if url is not None:
        part["image_url"] = url
    return part


def b64_block(data: str = SHOT_B64, media_type: Any = "image/png") -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


# -- Responses ----------------------------------------------------------------------------
def test_responses_images_keep_their_order_and_detail() -> None:
    content = [
        {"type": "input_text", "text": "before"},
        input_image(SHOT_URL, detail="high"),
        {"type": "input_text", "text": "between"},
        input_image(REMOTE),
        {"type": "input_text", "text": "after"},
    ]
    (message,) = responses_chat({"role": "user", "content": content})
    assert message == {
        "role": "user",
        "content": [
            text("before"),
            image_url(SHOT_URL, detail="high"),
            text("between"),
            image_url(REMOTE),  # no detail given: none added
            text("after"),
        ],
    }


@pytest.mark.parametrize("role", ["system", "developer"])
def test_responses_images_are_taken_in_system_and_developer_messages(role: str) -> None:
    (message,) = responses_chat({"role": role, "content": [input_image(SHOT_URL)]})
    assert message == {"role": "system", "content": [image_url(SHOT_URL)]}


def test_responses_text_only_content_stays_one_string() -> None:
    parts = [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    output = [{"type": "input_text", "text": "x"}, {"type": "input_text", "text": "y"}]
    chat = responses_chat(
        {"role": "user", "content": parts},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": output},
        {"type": "function_call_output", "call_id": "c1", "output": "plain"},
    )
    assert chat[0] == {"role": "user", "content": "a\nb"}
    assert chat[2] == {"role": "tool", "tool_call_id": "c1", "content": "x\ny"}
    assert chat[3] == {"role": "tool", "tool_call_id": "c1", "content": "plain"}


def test_responses_function_call_output_with_an_image_is_a_list() -> None:
    output = [{"type": "input_text", "text": "the screen:"}, input_image(SHOT_URL, detail="low")]
    chat = responses_chat(
        {"type": "function_call", "call_id": "c1", "name": "screenshot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": output},
    )
    assert chat[1] == {
        "role": "tool",
        "tool_call_id": "c1",
        "content": [text("the screen:"), image_url(SHOT_URL, detail="low")],
    }


@pytest.mark.parametrize(
    ("part", "error", "path", "fragment"),
    [
        (input_image(file_id="file_1"), Unprocessable, "input[0].content[1].file_id", "Files API"),
        (input_image(), BadRequest, "input[0].content[1].image_url", "non-empty string"),
        (input_image(None, image_url=7), BadRequest, "input[0].content[1].image_url", "string"),
        (input_image(""), BadRequest, "input[0].content[1].image_url", "non-empty string"),
        (input_image("file:///etc/passwd"), BadRequest, "input[0].content[1].image_url", "URL"),
        (input_image(SHOT_URL, detail="huge"), BadRequest, "input[0].content[1].detail", "one of"),
        (input_image(SHOT_URL, detail=["x"]), BadRequest, "input[0].content[1].detail", "one of"),
        (
            {"type": "input_file", "file_id": "file_1"},
            Unprocessable,
            "input[0].content[1]",
            "'input_file' content is not supported",
        ),
    ],
    ids=[
        "file-id",
        "no-url",
        "url-not-string",
        "empty-url",
        "scheme",
        "detail",
        "detail-list",
        "input-file",
    ],
)
def test_responses_images_that_cannot_be_taken_are_refused(
    part: dict[str, Any], error: type[TurnstileError], path: str, fragment: str
) -> None:
    content = [{"type": "input_text", "text": "look"}, part]
    with pytest.raises(error) as caught:
        responses_chat({"role": "user", "content": content})
    assert type(caught.value) is error
    assert caught.value.status == (422 if error is Unprocessable else 400)
    assert path in caught.value.message and fragment in caught.value.message


def test_responses_images_in_an_assistant_message_are_refused() -> None:
    content = [{"type": "output_text", "text": "x"}, input_image(SHOT_URL)]
    with pytest.raises(Unprocessable) as caught:
        responses_chat({"role": "assistant", "content": content})
    assert caught.value.status == 422 and "input[0].content[1]" in caught.value.message


def test_responses_a_file_id_image_in_a_function_call_output_is_refused() -> None:
    with pytest.raises(Unprocessable) as caught:
        responses_chat(
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [input_image(file_id="file_1")],
            }
        )
    assert caught.value.status == 422
    assert "input[0].output[0].file_id" in caught.value.message


# -- Messages -----------------------------------------------------------------------------
def test_messages_images_keep_their_order() -> None:
    content = [
        text("before"),
        b64_block(),
        text("between"),
        {"type": "image", "source": {"type": "url", "url": REMOTE}},
    ]
    (message,) = messages_chat({"role": "user", "content": content})
    assert message == {
        "role": "user",
        "content": [
            text("before"),
            image_url(f"data:image/png;base64,{SHOT_B64}"),
            text("between"),
            image_url(REMOTE),
        ],
    }
    assert message["content"][1]["image_url"]["url"] == SHOT_URL


def test_messages_text_only_content_stays_one_string() -> None:
    chat = messages_chat(
        {"role": "user", "content": [text("a"), text("b")]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f"}]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [text("x")]}],
        },
    )
    assert chat[0] == {"role": "user", "content": "a\nb"}
    assert chat[2] == {"role": "tool", "tool_call_id": "t1", "content": "x"}


def test_messages_a_tool_result_with_an_image_is_a_list() -> None:
    result = {
        "type": "tool_result",
        "tool_use_id": "t1",
        "content": [text("the screen:"), b64_block(media_type="image/png")],
    }
    chat = messages_chat(
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot"}]},
        {"role": "user", "content": [result, text("what now?")]},
    )
    assert chat[1] == {
        "role": "tool",
        "tool_call_id": "t1",
        "content": [text("the screen:"), image_url(SHOT_URL)],
    }
    assert chat[2] == {"role": "user", "content": "what now?"}


@pytest.mark.parametrize(
    ("block", "error", "path", "fragment"),
    [
        (
            {"type": "image", "source": {"type": "file", "file_id": "file_1"}},
            Unprocessable,
            "messages[0].content[1].source",
            "Files API",
        ),
        (b64_block(media_type="image/tiff"), BadRequest, "source.media_type", "one of"),
        (b64_block(media_type=None), BadRequest, "source.media_type", "one of"),
        (b64_block(media_type=["image/png"]), BadRequest, "source.media_type", "one of"),
        (b64_block(data=""), BadRequest, "messages[0].content[1].source.data", "base64"),
        (b64_block(data="@@not base64@@"), BadRequest, "source.data", "base64"),
        (b64_block(data=SHOT_URL), BadRequest, "source.data", "base64"),
        (
            {"type": "image", "source": {"type": "base64", "media_type": "image/png"}},
            BadRequest,
            "messages[0].content[1].source.data",
            "base64",
        ),
        (
            {"type": "image", "source": {"type": "url"}},
            BadRequest,
            "messages[0].content[1].source.url",
            "http(s)",
        ),
        (
            {"type": "image", "source": {"type": "url", "url": "ftp://h/x.png"}},
            BadRequest,
            "source.url",
            "http(s)",
        ),
        ({"type": "image"}, BadRequest, "messages[0].content[1].source", "object"),
        (
            {"type": "image", "source": {"type": "bytes"}},
            BadRequest,
            "messages[0].content[1].source.type",
            "not known",
        ),
        (
            {"type": "document", "source": {"type": "url", "url": REMOTE}},
            Unprocessable,
            "messages[0].content[1]",
            "document blocks are not supported",
        ),
    ],
    ids=[
        "file",
        "bad-media-type",
        "no-media-type",
        "list-media-type",
        "empty-data",
        "not-base64",
        "data-url",
        "no-data",
        "no-url",
        "ftp-url",
        "no-source",
        "source-type",
        "document",
    ],
)
def test_messages_images_that_cannot_be_taken_are_refused(
    block: dict[str, Any], error: type[TurnstileError], path: str, fragment: str
) -> None:
    with pytest.raises(error) as caught:
        messages_chat({"role": "user", "content": [text("look"), block]})
    assert type(caught.value) is error
    assert caught.value.status == (422 if error is Unprocessable else 400)
    assert path in caught.value.message and fragment in caught.value.message


def test_messages_a_bad_image_in_a_tool_result_names_its_path() -> None:
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [b64_block(data="")]}
    with pytest.raises(BadRequest) as caught:
        messages_chat(
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f"}]},
            {"role": "user", "content": [result]},
        )
    assert caught.value.status == 400
    assert "messages[1].content[0].content[0].source.data" in caught.value.message


def test_messages_images_in_assistant_messages_are_refused() -> None:
    with pytest.raises(Unprocessable) as caught:
        messages_chat(
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [text("see"), b64_block()]},
        )
    assert caught.value.status == 422 and "messages[1].content[1]" in caught.value.message


# -- through the app ----------------------------------------------------------------------
def test_images_sent_to_responses_and_messages_are_recorded_once_with_their_spans(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    settings = load_settings(
        None, {"output": out, "image_token_id": FAKE_IMAGE_TOKEN_ID}, environ={}
    )
    backend = FakeVLLM()
    with TestClient(create_app(settings, backend=backend)) as client:
        rid = client.post("/rollouts", json={}).json()["rollout_id"]
        content = [{"type": "input_text", "text": "What is this?"}, input_image(SHOT_URL)]
        resp = client.post(
            f"/rollouts/{rid}/v1/responses",
            json={"model": "m", "input": [{"role": "user", "content": content}]},
        )
        assert resp.status_code == 200, resp.text
        resp = client.post(
            f"/rollouts/{rid}/v1/messages",
            json={
                "model": "m",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": [b64_block(), text("And this?")]}],
            },
        )
        assert resp.status_code == 200, resp.text
        assert client.post(f"/rollouts/{rid}/finish", json={}).status_code == 200
    sent = [r[2] for r in backend.requests if r[1] == "/v1/chat/completions"]
    assert [m["content"] for body in sent if body for m in body["messages"]] == [
        [text("What is this?"), image_url(SHOT_URL)],
        [image_url(SHOT_URL), text("And this?")],
    ]
    sha = sha256_hex(SHOT)
    reader = open_output(out)
    media = reader.read("media").to_pylist()
    assert [(m["sha256"], m["rollout_id"]) for m in media] == [(sha, rid)]  # once
    assert reader.images([sha])[sha].data == SHOT
    turns = [t for t in reader.turns().to_pylist() if t["rollout_id"] == rid]
    assert len(turns) == 2
    for turn in turns:
        (span,) = turn["image_spans"]
        assert span["sha256"] == sha and span["url"] is None
        assert span["length"] == fake_image_tokens(SHOT_URL)
        start = span["start"]
        ids = turn["prompt_token_ids"][start : start + span["length"]]
        assert ids == [FAKE_IMAGE_TOKEN_ID] * span["length"]
