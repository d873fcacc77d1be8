"""TITO mode in front of SGLang: token IDs go to SGLang's `/v1/completions` through the
SGLang adapter, and SGLang's answer shapes (`matched_stop`, null top-logprob entries, no
`return_tokens_as_token_ids`) come back as an exact chat answer.

The SGLang server is a fake answering in the shapes of `tests/fixtures/sglang/`
(`completions_tokens.json`, from SGLang's protocol definitions); SGLang itself needs CUDA.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from turnstile.backends.sglang import SGLangBackend
from turnstile.dev.llama_cpp_assets import ensure_llama_cpp_assets
from turnstile.dev.template_corpus import PAIRINGS
from turnstile.dev.vocab import ensure_vocab_tokenizer, load_tokenizer
from turnstile.tito import build_engine

# llama.cpp's vocabularies and templates (a 76 MB download, cached); no vLLM.
pytestmark = pytest.mark.assets

QWEN25 = "Qwen-Qwen2.5-7B-Instruct.jinja"
IM_END = 151645


@dataclass
class _Resp:
    body: bytes
    status: int = 200
    headers: Mapping[str, str] = field(default_factory=lambda: {"Content-Type": "application/json"})
    served_by: str | None = None
    failover_from: str | None = None

    async def read(self) -> bytes:
        return self.body

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        yield self.body

    def close(self) -> None:
        return None


@dataclass
class FakeSGLang:
    """SGLang's `/v1/completions` with `return_token_ids`, sampling `plan` each call."""

    tokenizer: Any
    plan: list[int] = field(default_factory=list)
    base_url: str = "http://sglang"
    requests: list[dict[str, Any]] = field(default_factory=list)

    async def request(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> _Resp:
        assert path == "/v1/completions", path
        req = orjson.loads(body or b"{}")
        self.requests.append(req)
        ids = self.plan
        return _Resp(
            orjson.dumps(
                {
                    "id": "c0ffee",
                    "object": "text_completion",
                    "created": 1,
                    "model": "qwen",
                    "choices": [
                        {
                            "index": 0,
                            "text": self.tokenizer.decode(ids[:-1]),
                            "logprobs": {
                                "text_offset": [0] * len(ids),
                                "token_logprobs": [-0.5] * len(ids),
                                "tokens": [self.tokenizer.decode([t]) for t in ids],
                                "top_logprobs": [None] * len(ids),
                            },
                            "finish_reason": "stop",
                            "matched_stop": IM_END,
                            "token_ids": ids,
                            "prompt_token_ids": req["prompt"],
                        }
                    ],
                    "usage": {"prompt_tokens": len(req["prompt"]), "completion_tokens": len(ids)},
                }
            )
        )

    async def aclose(self) -> None:
        return None


async def test_tito_through_the_sglang_adapter_extends_token_for_token() -> None:
    hf = load_tokenizer(ensure_vocab_tokenizer(PAIRINGS[QWEN25], log=lambda _: None))
    fake = FakeSGLang(hf)
    template = ensure_llama_cpp_assets(log=lambda _: None) / "templates" / QWEN25
    engine = build_engine(SGLangBackend(fake), hf, template_path=template)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    fake.plan = [*hf.encode("Hello there!", add_special_tokens=False), IM_END]
    body = {
        "model": "qwen",
        "messages": messages,
        "return_token_ids": True,
        "logprobs": True,
        "return_tokens_as_token_ids": True,
    }
    first = orjson.loads(await (await engine.request("r", dict(body))).read())
    assert first["choices"][0]["message"]["content"] == "Hello there!"
    assert first["choices"][0]["token_ids"] == fake.plan
    assert first["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.5
    sent = fake.requests[0]
    assert "return_tokens_as_token_ids" not in sent and sent["return_token_ids"] is True
    context = sent["prompt"] + fake.plan
    messages += [
        {"role": "assistant", "content": "Hello there!"},
        {"role": "user", "content": "again"},
    ]
    fake.plan = [*hf.encode("Hi!", add_special_tokens=False), IM_END]
    second = orjson.loads(await (await engine.request("r", {**body, "messages": messages})).read())
    assert second["choices"][0]["message"]["content"] == "Hi!"
    assert second["prompt_token_ids"][: len(context)] == context
    assert engine.stats()["extended"] == 1
