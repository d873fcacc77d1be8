"""The SGLang adapter against fixtures of SGLang's real response shapes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from starlette.testclient import TestClient

from tests.fakes_backend import FakeResponse, FakeVLLM
from tests.fakes_sink import InMemorySink
from turnstile.backends.sglang import (
    GenerateStreamAssembler,
    SGLangBackend,
    chat_stream_mode,
    detect_kind,
    generate_request,
    translate_chat_request,
)
from turnstile.errors import BackendError
from turnstile.records import TokenSource, TurnStatus
from turnstile.server.app import create_app
from turnstile.settings import load_settings

FIXTURES = Path(__file__).parent.parent / "fixtures" / "sglang"
CHAT = json.loads((FIXTURES / "chat_nonstream.json").read_text())
PROMPT = CHAT["choices"][0]["prompt_token_ids"]
IDS = CHAT["choices"][0]["token_ids"]
LOGPROBS = [e["logprob"] for e in CHAT["choices"][0]["logprobs"]["content"]]
USER = [{"role": "user", "content": "Hi"}]


def fixture_bytes(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


class FakeSGLang:
    """Answers like an SGLang server, from the fixtures; records what it was sent."""

    def __init__(
        self,
        *,
        generate: str = "generate_stream.sse",
        chat: str = "chat_nonstream.json",
        cut_generate_after: int | None = None,
    ) -> None:
        self.base_url = "http://fake-sglang"
        self.generate = generate
        self.chat = chat
        self.cut = cut_generate_after
        self.requests: list[tuple[str, str, Any]] = []

    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        headers: Mapping[str, str],
        affinity: str | None = None,
    ) -> FakeResponse:
        parsed = orjson.loads(body) if body else None
        self.requests.append((method, path, parsed))
        json_h = {"Content-Type": "application/json"}
        if path == "/v1/models":
            return FakeResponse(200, json_h, [fixture_bytes("models.json")])
        if path == "/v1/chat/completions":
            assert parsed is not None and not parsed.get("stream"), "SGLang chat streams lack ids"
            return FakeResponse(200, json_h, [fixture_bytes(self.chat)])
        if path == "/v1/completions":
            return FakeResponse(200, json_h, [fixture_bytes("completions_tokens.json")])
        if path == "/generate":
            events = [e + b"\n\n" for e in fixture_bytes(self.generate).split(b"\n\n") if e]
            return FakeResponse(
                200, {"Content-Type": "text/event-stream"}, events, die_after=self.cut
            )
        return FakeResponse(404, json_h, [b'{"error": "not found"}'])

    async def aclose(self) -> None:
        return None


class Renderer:
    def __init__(self) -> None:
        self.calls: list[list[dict[str, Any]]] = []

    def render_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        self.calls.append(messages)
        return list(PROMPT)


def make(tmp_path: Path, fake: FakeSGLang, renderer: Renderer | None) -> tuple[Any, InMemorySink]:
    sink = InMemorySink()
    settings = load_settings(None, {"output": tmp_path / "out"}, environ={})
    app = create_app(settings, backend=SGLangBackend(fake, renderer=renderer), sink=sink)
    return app, sink


def sse_objects(raw: bytes) -> list[Any]:
    out = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: ") and block != b"data: [DONE]":
            out.append(orjson.loads(block[6:]))
    return out


def test_whole_chat_asks_sglang_for_prompt_ids_and_records_them(tmp_path: Path) -> None:
    fake = FakeSGLang()
    app, sink = make(tmp_path, fake, None)
    with TestClient(app) as client:
        resp = client.post("/v1/chat/completions", json={"model": "qwen3-tiny", "messages": USER})
        assert resp.status_code == 200
        got = resp.json()
    sent = fake.requests[-1][2]
    assert sent["return_token_ids"] is True and sent["return_prompt_token_ids"] is True
    assert sent["logprobs"] is True and "return_tokens_as_token_ids" not in sent
    assert got["choices"][0]["message"]["content"] == "Hello there!"
    assert got["choices"][0]["logprobs"] is None  # the client did not ask for them
    (turn,) = sink.turns
    assert turn.token_source is TokenSource.BACKEND and turn.status is TurnStatus.OK
    assert turn.prompt_token_ids.tolist() == PROMPT
    assert turn.completion_token_ids.tolist() == IDS
    assert turn.behavior_logprobs.tolist() == [np.float32(v) for v in LOGPROBS]


@pytest.mark.parametrize(
    ("fixture", "finish"),
    [("generate_stream.sse", "stop"), ("generate_stream_incremental.sse", "length")],
)
def test_streamed_chat_goes_through_generate_with_exact_ids(
    tmp_path: Path, fixture: str, finish: str
) -> None:
    fake, renderer = FakeSGLang(generate=fixture), Renderer()
    app, sink = make(tmp_path, fake, renderer)
    body = {
        "model": "qwen3-tiny",
        "messages": USER,
        "stream": True,
        "max_tokens": 4,
        "temperature": 0.7,
        "seed": 3,
        "stream_options": {"include_usage": True},
    }
    with TestClient(app) as client:
        resp = client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200
        raw = resp.content
    method, path, sent = fake.requests[-1]
    assert (method, path) == ("POST", "/generate")
    assert sent["input_ids"] == PROMPT and sent["stream"] is True
    assert sent["return_logprob"] is True and sent["logprob_start_len"] == -1
    assert sent["sampling_params"] == {"max_new_tokens": 4, "temperature": 0.7, "sampling_seed": 3}
    assert renderer.calls == [USER]
    chunks = sse_objects(raw)
    assert raw.endswith(b"data: [DONE]\n\n")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "Hello there!"
    # the client asked for neither ids nor logprobs: they are stripped from its chunks
    assert all(c["choices"][0].get("token_ids") is None for c in chunks if c["choices"])
    assert chunks[-1]["usage"] == {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}
    (turn,) = sink.turns
    assert turn.token_source is TokenSource.BACKEND and turn.status is TurnStatus.OK
    assert turn.prompt_token_ids.tolist() == PROMPT
    assert turn.completion_token_ids.tolist() == IDS
    assert turn.behavior_logprobs.tolist() == [np.float32(v) for v in LOGPROBS]
    assert turn.finish_reason == finish
    assert json.loads(turn.response_message_json or "")["content"] == "Hello there!"


def test_client_that_asks_for_ids_and_logprobs_gets_vllm_shaped_chunks(tmp_path: Path) -> None:
    app, _ = make(tmp_path, FakeSGLang(), Renderer())
    body = {
        "model": "qwen3-tiny",
        "messages": USER,
        "stream": True,
        "logprobs": True,
        "return_token_ids": True,
    }
    with TestClient(app) as client:
        chunks = sse_objects(client.post("/v1/chat/completions", json=body).content)
    assert chunks[0]["prompt_token_ids"] == PROMPT
    ids = [i for c in chunks[1:] for i in c["choices"][0]["token_ids"]]
    assert ids == IDS
    entries = [e for c in chunks[1:] for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["logprob"] for e in entries] == LOGPROBS
    assert [e["token"] for e in entries] == ["Hello", " there", "!", ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] == 151645


def test_stream_without_tokenizer_or_with_tools_restreams_the_whole_answer(tmp_path: Path) -> None:
    fake = FakeSGLang(chat="chat_tool_calls.json")
    app, sink = make(tmp_path, fake, Renderer())
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    body = {"model": "qwen3-tiny", "messages": USER, "stream": True, "tools": tools}
    with TestClient(app) as client:
        raw = client.post("/v1/chat/completions", json=body).content
    _, path, sent = fake.requests[-1]
    assert path == "/v1/chat/completions" and "stream" not in sent
    assert sent["return_prompt_token_ids"] is True
    chunks = sse_objects(raw)
    call = chunks[1]["choices"][0]["delta"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and call["index"] == 0
    (turn,) = sink.turns
    assert turn.prompt_token_ids.tolist() == PROMPT and turn.completion_token_ids.tolist() == IDS
    message = json.loads(turn.response_message_json or "")
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert "I should call it." in json.dumps(message)  # the reasoning is kept
    assert turn.finish_reason == "tool_calls"


def test_completions_pass_through_with_ids(tmp_path: Path) -> None:
    fake = FakeSGLang()
    app, sink = make(tmp_path, fake, None)
    with TestClient(app) as client:
        resp = client.post("/v1/completions", json={"model": "qwen3-tiny", "prompt": PROMPT})
        assert resp.status_code == 200
    sent = fake.requests[-1][2]
    assert sent["return_token_ids"] is True and "return_tokens_as_token_ids" not in sent
    (turn,) = sink.turns
    assert turn.prompt_token_ids.tolist() == PROMPT and turn.completion_token_ids.tolist() == IDS
    assert turn.behavior_logprobs.tolist() == [np.float32(v) for v in LOGPROBS]


def test_generate_stream_cut_is_recorded_as_aborted(tmp_path: Path) -> None:
    app, sink = make(tmp_path, FakeSGLang(cut_generate_after=2), Renderer())
    body = {"model": "qwen3-tiny", "messages": USER, "stream": True}
    with TestClient(app) as client:
        raw = client.post("/v1/chat/completions", json=body).content
    assert b"error" in raw and raw.endswith(b"data: [DONE]\n\n")
    (turn,) = sink.turns
    assert turn.status is TurnStatus.ABORTED
    assert turn.completion_token_ids.tolist() == IDS[:2]  # the two events before the cut


def test_assembler_rejects_events_without_ids() -> None:
    asm = GenerateStreamAssembler("m", PROMPT, include_usage=False)
    with pytest.raises(BackendError):
        asm.event({"text": "x", "meta_info": {}})


def test_sglang_chat_stream_itself_carries_no_token_ids() -> None:
    """Why streamed chat goes through /generate: SGLang's chat chunks have no ids."""
    chunks = sse_objects(fixture_bytes("chat_stream.sse"))
    assert chunks and all("token_ids" not in c["choices"][0] for c in chunks)


def test_request_translation_and_stream_modes() -> None:
    body = {
        "messages": USER,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "max_completion_tokens": 8,
        "top_logprobs": 2,
        "stop": ["\n"],
    }
    chat = translate_chat_request(body)
    assert chat["return_prompt_token_ids"] is True and "return_tokens_as_token_ids" not in chat
    gen = generate_request(chat, [1, 2])
    assert gen["sampling_params"] == {"max_new_tokens": 8, "stop": ["\n"]}
    assert gen["top_logprobs_num"] == 2
    assert chat_stream_mode(body, Renderer()) == "generate"
    assert chat_stream_mode(body, None) == "restream"
    assert chat_stream_mode({**body, "n": 2}, Renderer()) == "restream"


def test_kind_detection() -> None:
    assert asyncio.run(detect_kind(FakeSGLang())) == "sglang"
    assert asyncio.run(detect_kind(FakeVLLM())) == "vllm"
