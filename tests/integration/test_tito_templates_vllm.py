"""TITO against the real CPU vLLM with the templates the audit used to refuse.

The tiny Qwen3 model is served with three chat templates: Qwen3's own (its reasoning of
earlier turns is dropped by a re-render), a DeepSeek-R1 distill's (DeepSeek's markers in the
Qwen2 vocabulary's special slots, its generation prompt opening a <think> block the history
does not render) and Hermes 3's (ChatML, whose last tool response renders without the
newline it has once another message follows). Each is TITO-exact but not
deployment-faithful, so TITO runs with them in the default `tito_history: sampled`, each
with its verified fix (which keeps earlier reasoning, or Hermes' last newline). A multi-turn
conversation with a tool round must give prompts that extend the previous prompt + sampled
completion token for token, one sample equal to the backend's token stream (0 mismatched
tokens), and a `tito_context_faithful` value on every turn. Where Turnstile's tokenizer is
the served model's (Qwen3, Hermes), the first prompt must equal vLLM's tokens for the
template's rendering (`/tokenize`; the shared development server does not take
request-supplied chat templates, which would need `--trust-request-chat-template`).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.live import LiveServer
from tests.published import published_rollout
from turnstile.dev.llama_cpp_assets import ensure_llama_cpp_assets
from turnstile.dev.template_corpus import R1_DISTILL_QWEN
from turnstile.dev.vocab import build_tokenizer_dir
from turnstile.server.app import create_app
from turnstile.settings import load_settings

pytestmark = pytest.mark.assets

MODEL = "tiny-qwen3"
# Short generations keep the suite fast on two CPU cores.
MAX_TOKENS = 8
SEED = 11
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string"}},
                "required": ["word"],
            },
        },
    }
]
TEMPLATES = {
    "qwen3": "Qwen-Qwen3-0.6B.jinja",
    "r1-distill": "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
    "hermes": "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
}


@pytest.fixture(scope="module")
def assets() -> Path:
    return ensure_llama_cpp_assets(log=lambda _: None)


def _tokenizer_dir(name: str, qwen3_dir: Path, assets: Path, tmp: Path) -> Path:
    if name != "r1-distill":
        return qwen3_dir  # Qwen3's and Hermes' markers are Qwen3 tokens
    vocab = assets / "vocab" / R1_DISTILL_QWEN.vocab_file
    return build_tokenizer_dir(vocab, None, tmp / "r1", R1_DISTILL_QWEN)


@pytest.fixture
def serve(vllm_server: Any, tmp_path: Path) -> Iterator[list[LiveServer]]:
    servers: list[LiveServer] = []
    yield servers
    for server in servers:
        server.__exit__()


def _converse(url: str, rollout: str) -> list[dict[str, Any]]:
    """A user turn, a tool round (the harness answers whatever the model wrote with a tool
    message only when it called a tool; otherwise a user message), two more user turns."""
    client = openai.OpenAI(base_url=f"{url}/rollouts/{rollout}/v1", api_key="k", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Define 'naïve', please."}]
    follow = ["And 'café'?", "Thanks\t", "  bye  "]
    for i, text in enumerate([*follow, None]):
        kwargs: dict[str, Any] = {
            "model": MODEL,
            "messages": messages,
            "tools": TOOLS,
            "max_tokens": MAX_TOKENS,
            "seed": SEED + i,
        }
        reply: dict[str, Any]
        if i % 2 == 1:
            chunks = client.chat.completions.create(stream=True, **kwargs)
            parts = [c.choices[0].delta.content or "" for c in chunks if c.choices]
            reply = {"role": "assistant", "content": "".join(parts)}
        else:
            answer = client.chat.completions.create(**kwargs).choices[0].message
            dumped = answer.model_dump(exclude_none=True)
            reply = {k: v for k, v in dumped.items() if k in ("role", "content", "tool_calls")}
        if text is None:
            break
        messages.append(reply)
        for call in reply.get("tool_calls") or ():
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": '{"ok":1}'})
        messages.append({"role": "user", "content": text})
    assert httpx.post(f"{url}/rollouts/{rollout}/finish", timeout=30).status_code == 200
    return messages


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_tito_is_exact_with_the_template(
    name: str,
    serve: list[LiveServer],
    vllm_server: Any,
    qwen3_tokenizer_dir: Path,
    assets: Path,
    tmp_path: Path,
) -> None:
    template = assets / "templates" / TEMPLATES[name]
    tokenizer = _tokenizer_dir(name, qwen3_tokenizer_dir, assets, tmp_path)
    settings = load_settings(
        None,
        {
            "backends": [vllm_server.base_url],
            "output": tmp_path / "out",
            "tokenizer": tokenizer,
            "mode": "tito",
            "chat_template": template,
            "shard_max_age_s": 0.2,
        },
        environ={},
    )
    app = create_app(settings)
    info = app.state.tito.template_info
    assert info["tito_exact"] and info["history"] == "sampled"
    server = LiveServer(app).__enter__()
    serve.append(server)
    messages = _converse(server.url, f"{name}-1")
    samples, turns = published_rollout(tmp_path / "out", f"{name}-1")
    assert len(turns) == 4 and all(t["status"] == "ok" for t in turns)
    if name != "r1-distill":  # same tokenizer as the served model: vLLM renders alike
        text = app.state.tito.renderer.render(messages[:1], TOOLS, None, True)
        rendered = httpx.post(
            f"{vllm_server.base_url}/tokenize",
            json={"model": MODEL, "prompt": text, "add_special_tokens": False},
            timeout=30,
        ).json()["tokens"]
        assert turns[0]["prompt_token_ids"] == rendered
    for prev, turn in itertools.pairwise(turns):
        context = prev["prompt_token_ids"] + prev["completion_token_ids"]
        assert turn["prompt_token_ids"][: len(context)] == context
    assert len(samples) == 1 and samples[0]["break_kind"] == "first"
    last = turns[-1]
    stream = last["prompt_token_ids"] + last["completion_token_ids"]
    assert samples[0]["input_ids"] == stream  # 0 mismatched tokens
    assert all(isinstance(t["tito_context_faithful"], bool) for t in turns)
    assert turns[0]["tito_context_faithful"] is True  # a first turn is the template's own
    stats = httpx.get(f"{server.url}/stats", timeout=10).json()["tito"]
    assert stats["extended"] == 3 and stats["split"] == 0
    assert stats["unfaithful"] == sum(not t["tito_context_faithful"] for t in turns)
    json.dumps(stats)
