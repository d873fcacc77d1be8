"""How answers go out and are read: the first event of a stream at once, the rest of each
read in one send; whole answers by the compiled scanner where it is built.

The stream backend here delivers several events in one read (as a fast engine's first
read does); the proxy must hand the first event to the client before it decodes the
others, and every later read's events as one piece, while recording all of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
import pytest

from tests.fakes_sink import InMemorySink
from turnstile.backends.fake import (
    SSE_DONE,
    SSE_HEADERS,
    FakeResponse,
    chat_role_chunk,
    chat_token_chunk,
    logprob_entry,
    sse_event,
)
from turnstile.bench.backend import Corpus, Shape
from turnstile.output.recorder import Recorder
from turnstile.proxy import tokens
from turnstile.proxy.capture import CHAT
from turnstile.proxy.core import Proxy, Relay, StreamRelay

PROMPT = list(range(100_000, 100_400))  # a first chunk large enough to be scanned
IDS = [7, 8, 9, 10, 11]


class _Reads:
    """A backend whose stream arrives in the given reads."""

    base_url = "http://fake"

    def __init__(self, reads: list[bytes]) -> None:
        self.reads = reads

    async def request(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> FakeResponse:
        return FakeResponse(200, SSE_HEADERS, list(self.reads))

    async def aclose(self) -> None:
        return None


def _events() -> list[bytes]:
    events = [sse_event(chat_role_chunk("c", "m", 1, PROMPT))]
    for i, token in enumerate(IDS):
        entry = logprob_entry(f"t{token}", -0.5 * i)
        last = "stop" if i == len(IDS) - 1 else None
        events.append(sse_event(chat_token_chunk("c", "m", 0, f"t{token}", entry, token, last)))
    return events


async def test_the_first_event_goes_out_alone_then_each_read_in_one_send() -> None:
    events = _events()
    reads = [b"".join(events[:4]), b"".join(events[4:]) + SSE_DONE]
    sink = InMemorySink()
    proxy = Proxy(
        _Reads(reads),
        Recorder(sink, max_backlog=100),
        top_logprobs=0,
        policy_version=0,
        idle_timeout_s=60.0,
    )
    request = {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "logprobs": True,
        "return_token_ids": True,
    }
    relay = await proxy.complete(CHAT, orjson.dumps(request), rollout_id="r")
    assert isinstance(relay, StreamRelay)
    pieces = [piece async for piece in relay.chunks]
    assert pieces == [events[0], b"".join(events[1:4]), b"".join(events[4:]), SSE_DONE]
    (turn,) = proxy.registry.get("r").turns  # recorded whole: every event was decoded
    assert turn.prompt_token_ids.tolist() == PROMPT
    assert turn.completion_token_ids.tolist() == IDS
    assert turn.behavior_logprobs.tolist() == [-0.5 * i for i in range(len(IDS))]


@pytest.mark.skipif(not tokens.COMPILED, reason="the extension is not built")
@pytest.mark.parametrize("client_fields", [True, False])
async def test_whole_answers_are_read_by_the_compiled_scanner(
    monkeypatch: pytest.MonkeyPatch, client_fields: bool
) -> None:
    """The proxy reads whole answers with the extension when it is built: for a client that
    asked for the recorded fields and for one that did not (then they are spliced out)."""
    calls: list[int] = []
    assert tokens._tokenscan is not None
    real = tokens._tokenscan.scan

    class Counting:
        @staticmethod
        def scan(body: bytes, completions: bool, as_ids: bool) -> Any:
            calls.append(len(body))
            return real(body, completions, as_ids)

    monkeypatch.setattr(tokens, "_tokenscan", Counting)
    corpus = Corpus(300, 20)
    raw = corpus.answer(Shape(False, True, True, 0, False))
    assert isinstance(raw, bytes)
    body = raw[raw.index(b"\r\n\r\n") + 4 :]
    proxy = Proxy(
        _Reads([body]),
        Recorder(InMemorySink(), max_backlog=100),
        top_logprobs=0,
        policy_version=0,
        idle_timeout_s=60.0,
    )
    request: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    if client_fields:
        request |= {"logprobs": True, "return_token_ids": True}
    relay = await proxy.complete(CHAT, orjson.dumps(request), rollout_id="w")
    assert isinstance(relay, Relay)
    assert calls == [len(body)]
    sent = orjson.loads(relay.body)
    if client_fields:
        assert relay.body == body  # forwarded untouched
    else:
        assert sent["prompt_token_ids"] is None and sent["choices"][0]["logprobs"] is None
        assert sent["choices"][0]["message"] == orjson.loads(body)["choices"][0]["message"]
    (turn,) = proxy.registry.get("w").turns
    assert turn.prompt_token_ids.tolist() == corpus.prompt_ids
    assert turn.completion_token_ids.tolist() == corpus.ids
