"""TITO mode against the real CPU vLLM, beside record mode on the same conversation.

The harness (the openai client) runs a multi-turn conversation with awkward content,
streaming and not. In TITO mode Turnstile sends vLLM token IDs on `/v1/completions`; the
first prompt must equal vLLM's own rendering of the messages (`/tokenize`), every later
prompt must extend the previous prompt + sampled completion token for token, and the
rollout must stitch into one sample equal to the backend's token stream. In record mode the
same conversation re-rendered by vLLM breaks where the random model's text does not
survive a re-render, and every break is detected and classified.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.live import LiveServer
from tests.published import published_rollout
from turnstile.server.app import create_app
from turnstile.settings import load_settings

MODEL = "tiny-qwen3"
# Short generations keep the suite fast on two CPU cores.
MAX_TOKENS = 10
SEED = 7
USER_TURNS = [
    "Hi there",
    '  JSON: {"b":1.0 ,"a": true}  ',
    "naïve café ☕ and 1 vs 1.0",
    "",
    "last\t",
]


@pytest.fixture
def serve(
    vllm_server: Any, qwen3_tokenizer_dir: Path, tmp_path: Path
) -> Iterator[Callable[[str], LiveServer]]:
    servers: list[LiveServer] = []

    def _serve(mode: str) -> LiveServer:
        settings = load_settings(
            None,
            {
                "backends": [vllm_server.base_url],
                "output": tmp_path / mode,
                "tokenizer": qwen3_tokenizer_dir,
                "mode": mode,
                "shard_max_age_s": 0.2,
            },
            environ={},
        )
        server = LiveServer(create_app(settings)).__enter__()
        servers.append(server)
        return server

    yield _serve
    for server in servers:
        server.__exit__()


def _converse(url: str, rollout: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/rollouts/{rollout}/v1", api_key="k", max_retries=0)
    messages: list[dict[str, Any]] = []
    for i, text in enumerate(USER_TURNS):
        messages.append({"role": "user", "content": text})
        kwargs: dict[str, Any] = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": MAX_TOKENS,
            "seed": SEED + i,
        }
        if i % 2:
            parts, finish = [], None
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
                    finish = chunk.choices[0].finish_reason or finish
            content = "".join(parts)
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            content, finish = choice.message.content or "", choice.finish_reason
        assert finish in ("stop", "length")
        messages.append({"role": "assistant", "content": content})
    assert httpx.post(f"{url}/rollouts/{rollout}/finish", timeout=30).status_code == 200


def test_tito_against_vllm_is_exact_and_record_mode_flags_every_break(
    serve: Callable[[str], LiveServer], vllm_server: Any, tmp_path: Path
) -> None:
    tito = serve("tito")
    _converse(tito.url, "tito-1")
    samples, turns = published_rollout(tmp_path / "tito", "tito-1")
    assert len(turns) == len(USER_TURNS)
    assert all(t["token_source"] == "backend" and t["status"] == "ok" for t in turns)
    first = httpx.post(
        f"{vllm_server.base_url}/tokenize",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": USER_TURNS[0]}],
            "add_generation_prompt": True,
        },
        timeout=30,
    ).json()["tokens"]
    assert turns[0]["prompt_token_ids"] == first
    for prev, turn in itertools.pairwise(turns):
        context = prev["prompt_token_ids"] + prev["completion_token_ids"]
        assert turn["prompt_token_ids"][: len(context)] == context
    assert len(samples) == 1 and samples[0]["break_kind"] == "first"
    last = turns[-1]
    assert samples[0]["input_ids"] == last["prompt_token_ids"] + last["completion_token_ids"]
    assert samples[0]["num_loss_tokens"] == sum(t["num_completion_tokens"] for t in turns)
    stats = httpx.get(f"{tito.url}/stats", timeout=10).json()["tito"]
    assert stats["extended"] == len(USER_TURNS) - 1 and stats["split"] == 0

    record = serve("record")
    _converse(record.url, "record-1")
    samples, turns = published_rollout(tmp_path / "record", "record-1")
    true_breaks = 0
    for prev, turn in itertools.pairwise(turns):
        context = prev["prompt_token_ids"] + prev["completion_token_ids"]
        true_breaks += turn["prompt_token_ids"][: len(context)] != context
    kinds = [s["break_kind"] for s in samples if s["break_kind"] != "first"]
    # The random model ends turns at max_tokens without <|im_end|>: every re-render drifts.
    assert true_breaks > 0
    assert len(kinds) == true_breaks
    assert set(kinds) <= {"rerender", "tokenization", "truncated"}
