"""TITO mode on the Messages and Responses routes, against the real CPU vLLM.

A Claude Code-like session (the `anthropic` SDK, the whole conversation sent back every
call, the answer's blocks echoed as returned) and a Codex-like one (the `openai` SDK's
Responses, the output items echoed back with `store: false`), then a chain by
`previous_response_id`: every later prompt must extend the previous prompt + sampled
completion token for token, and each rollout must stitch into one sample.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.live import LiveServer
from tests.published import published_rollout
from turnstile.server.app import create_app
from turnstile.settings import load_settings

MODEL = "tiny-qwen3"
MAX_TOKENS = 10
USER_TURNS = ["Hi there", "naïve café ☕", "and then?", "last\t"]


@pytest.fixture
def tito(vllm_server: Any, qwen3_tokenizer_dir: Path, tmp_path: Path) -> Iterator[LiveServer]:
    settings = load_settings(
        None,
        {
            "backends": [vllm_server.base_url],
            "output": tmp_path / "out",
            "tokenizer": qwen3_tokenizer_dir,
            "mode": "tito",
            "shard_max_age_s": 0.2,
        },
        environ={},
    )
    with LiveServer(create_app(settings)) as server:
        yield server


def _finished(url: str, out: Path, rollout: str) -> tuple[list[Any], list[Any]]:
    assert httpx.post(f"{url}/rollouts/{rollout}/finish", timeout=30).status_code == 200
    return published_rollout(out, rollout)


def _assert_one_exact_sample(samples: list[Any], turns: list[Any], calls: int) -> None:
    assert len(turns) == calls
    assert all(t["status"] == "ok" and t["token_source"] == "backend" for t in turns)
    for prev, turn in itertools.pairwise(turns):
        context = prev["prompt_token_ids"] + prev["completion_token_ids"]
        assert turn["prompt_token_ids"][: len(context)] == context
    assert len(samples) == 1 and samples[0]["break_kind"] == "first"
    last = turns[-1]
    assert samples[0]["input_ids"] == last["prompt_token_ids"] + last["completion_token_ids"]


def test_a_claude_code_like_session_stitches_exactly(tito: LiveServer, tmp_path: Path) -> None:
    rid = "claude-tito"
    client = anthropic.Anthropic(base_url=f"{tito.url}/rollouts/{rid}", api_key="k", max_retries=0)
    messages: list[Any] = []
    for i, text in enumerate(USER_TURNS):
        messages.append({"role": "user", "content": [{"type": "text", "text": text}]})
        kwargs: Any = {"model": MODEL, "max_tokens": MAX_TOKENS, "system": "Be brief."}
        if i % 2:
            with client.messages.stream(messages=messages, **kwargs) as stream:
                reply = stream.get_final_message()
        else:
            reply = client.messages.create(messages=messages, **kwargs)
        blocks = [b.model_dump(exclude_none=True) for b in reply.content]
        messages.append({"role": "assistant", "content": blocks})
    samples, turns = _finished(tito.url, tmp_path / "out", rid)
    _assert_one_exact_sample(samples, turns, len(USER_TURNS))
    stats = httpx.get(f"{tito.url}/stats", timeout=10).json()["tito"]
    assert stats["split"] == 0 and stats["refused"] == 0


def test_a_codex_like_session_stitches_exactly(tito: LiveServer, tmp_path: Path) -> None:
    rid = "codex-tito"
    client = openai.OpenAI(base_url=f"{tito.url}/rollouts/{rid}/v1", api_key="k", max_retries=0)
    items: list[Any] = []
    for i, text in enumerate(USER_TURNS):
        items.append({"role": "user", "content": [{"type": "input_text", "text": text}]})
        kwargs: Any = {
            "model": MODEL,
            "instructions": "Be brief.",
            "max_output_tokens": MAX_TOKENS,
            "store": False,
        }
        if i % 2:
            with client.responses.stream(input=items, **kwargs) as stream:
                response = stream.get_final_response()
        else:
            response = client.responses.create(input=items, **kwargs)
        items += [item.model_dump(exclude_none=True) for item in response.output]
    samples, turns = _finished(tito.url, tmp_path / "out", rid)
    _assert_one_exact_sample(samples, turns, len(USER_TURNS))


def test_a_previous_response_id_chain_stitches_exactly(tito: LiveServer, tmp_path: Path) -> None:
    rid = "chain-tito"
    client = openai.OpenAI(base_url=f"{tito.url}/rollouts/{rid}/v1", api_key="k", max_retries=0)
    previous = None
    for text in USER_TURNS:
        response = client.responses.create(
            model=MODEL, input=text, max_output_tokens=MAX_TOKENS, previous_response_id=previous
        )
        previous = response.id
    samples, turns = _finished(tito.url, tmp_path / "out", rid)
    _assert_one_exact_sample(samples, turns, len(USER_TURNS))
