"""Token fidelity under random inputs: what is recorded is exactly what the backend sent.

A vLLM-shaped backend answers each request with token IDs and logprobs drawn by
hypothesis (any int32 ID, any float32 logprob including -0.0, tiny and huge ones),
non-streaming or streaming with random grouping of tokens into events. The recorded
turn must hold the same prompt IDs, completion IDs and logprobs (bit for bit as
float32), and every per-token array must be as long as its token array.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from tests.fakes_backend import FakeResponse
from tests.fakes_sink import InMemorySink
from turnstile.records import TurnRecord
from turnstile.server.app import create_app
from turnstile.settings import load_settings

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class Draw:
    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]
    groups: list[int]  # tokens per stream event
    finish_reason: str


class RandomVLLM:
    """Answers chat completions with the IDs and logprobs of `self.draw`."""

    base_url = "http://random-vllm"

    def __init__(self) -> None:
        self.draw: Draw | None = None

    async def request(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> FakeResponse:
        json_head = {"Content-Type": "application/json"}
        if path != "/v1/chat/completions":
            return FakeResponse(200, json_head, [b'{"object": "list", "data": []}'])
        assert self.draw is not None and body is not None
        d, parsed = self.draw, orjson.loads(body)
        entries: list[dict[str, Any]] = [
            {"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
            for t, lp in zip(d.ids, d.logprobs, strict=True)
        ]
        text = "".join(f"<{t}>" for t in d.ids)
        if not parsed.get("stream"):
            out = {
                "id": "x",
                "object": "chat.completion",
                "created": 1,
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": d.finish_reason,
                        "stop_reason": None,
                        "token_ids": d.ids,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": {"content": entries},
                    }
                ],
                "prompt_token_ids": d.prompt_ids,
            }
            return FakeResponse(200, json_head, [orjson.dumps(out)])
        events: list[dict[str, Any]] = [
            {
                "id": "x",
                "object": "chat.completion.chunk",
                "model": "m",
                "prompt_token_ids": d.prompt_ids,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
        ]
        start = 0
        for n, size in enumerate(d.groups):
            part = slice(start, start + size)
            start += size
            last = n == len(d.groups) - 1
            events.append(
                {
                    "id": "x",
                    "object": "chat.completion.chunk",
                    "model": "m",
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"content": "".join(f"<{t}>" for t in d.ids[part])},
                            "logprobs": {"content": entries[part]},
                            "token_ids": d.ids[part],
                            "finish_reason": d.finish_reason if last else None,
                        }
                    ],
                }
            )
        raw = [b"data: " + orjson.dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]
        return FakeResponse(200, {"Content-Type": "text/event-stream"}, raw)

    async def aclose(self) -> None:
        pass


float32s = st.floats(width=32, allow_nan=False, allow_infinity=False, max_value=0.0)
int32s = st.integers(0, 2**31 - 1)


@st.composite
def draws(draw: st.DrawFn) -> Draw:
    ids = draw(st.lists(int32s, min_size=1, max_size=40))
    logprobs = draw(st.lists(float32s, min_size=len(ids), max_size=len(ids)))
    groups, left = [], len(ids)
    while left:
        size = draw(st.integers(1, left))
        groups.append(size)
        left -= size
    return Draw(
        draw(st.lists(int32s, min_size=1, max_size=60)),
        ids,
        logprobs,
        groups,
        draw(st.sampled_from(["stop", "length"])),
    )


def _recorded(sink: InMemorySink, rollout_id: str) -> TurnRecord:
    deadline = time.monotonic() + 10
    while True:
        found = [t for t in sink.turns if t.rollout_id == rollout_id]
        if found:
            (turn,) = found
            return turn
        assert time.monotonic() < deadline, "the turn was never recorded"
        time.sleep(0.002)


def test_recorded_tokens_and_logprobs_equal_what_the_backend_sent(tmp_path: Path) -> None:
    backend = RandomVLLM()
    sink = InMemorySink()
    app = create_app(
        load_settings(None, {"output": tmp_path / "out"}, environ={}), backend=backend, sink=sink
    )
    with TestClient(app) as client:

        @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(draws(), st.booleans())
        def check(d: Draw, stream: bool) -> None:
            backend.draw = d
            rid = uuid.uuid4().hex
            resp = client.post(
                f"/rollouts/{rid}/v1/chat/completions", json={**BODY, "stream": stream}
            )
            assert resp.status_code == 200
            turn = _recorded(sink, rid)
            assert turn.prompt_token_ids.tolist() == d.prompt_ids
            assert turn.completion_token_ids.tolist() == d.ids
            assert turn.behavior_logprobs.dtype == np.float32
            assert (
                turn.behavior_logprobs.tobytes()
                == np.asarray(d.logprobs, dtype=np.float32).tobytes()
            )
            assert len(turn.behavior_logprobs) == len(turn.completion_token_ids)
            assert turn.finish_reason == d.finish_reason

        check()
