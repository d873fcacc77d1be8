"""The embedded vLLM returns the token IDs Turnstile records, tokenized as we tokenize.

No Turnstile code is involved: this checks the backend and the fixture tokenizer.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from turnstile.dev.devstack import VLLMServer

# A non-streaming chat call with one or two dozen tokens takes well under a second; allow
# for a loaded CI runner.
REQUEST_TIMEOUT_S = 60.0

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three prime numbers. Äpfel, 東京 and emoji 🙂 too."},
]


def _post(server: VLLMServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        server.base_url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        payload: dict[str, Any] = json.load(response)
    return payload


def test_chat_token_ids_match_tokenize_and_local_tokenizer(
    vllm_server: VLLMServer, qwen3_tokenizer_dir: Path
) -> None:
    chat = _post(
        vllm_server,
        "/v1/chat/completions",
        {
            "model": vllm_server.served_model_name,
            "messages": MESSAGES,
            "max_tokens": 12,
            "temperature": 1.0,
            "return_token_ids": True,
            "logprobs": True,
        },
    )
    tokenized = _post(
        vllm_server,
        "/tokenize",
        {
            "model": vllm_server.served_model_name,
            "messages": MESSAGES,
            "add_generation_prompt": True,
        },
    )
    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir))
    local_ids = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )

    prompt_ids = chat["prompt_token_ids"]
    assert prompt_ids == tokenized["tokens"]
    assert prompt_ids == local_ids
    assert prompt_ids[-3:] == tokenizer.encode("<|im_start|>assistant\n")

    choice = chat["choices"][0]
    assert choice["token_ids"], "vLLM returned no completion token IDs"
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"])
    assert len(choice["token_ids"]) == chat["usage"]["completion_tokens"]
