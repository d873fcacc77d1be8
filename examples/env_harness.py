"""Stands in for a harness you do not control: it only reads the standard variables.

The `openai` SDK (and most agent frameworks and coding agents built on it) take
`OPENAI_BASE_URL` and `OPENAI_API_KEY` from the environment; nothing here knows about
Turnstile. `env_recipe.sh` points those variables at a rollout.
"""

from __future__ import annotations

import os

import openai

MODEL = os.environ.get("TURNSTILE_MODEL", "tiny-qwen3")
MAX_TOKENS = int(os.environ.get("TURNSTILE_EXAMPLE_MAX_TOKENS", "24"))

client = openai.OpenAI()  # OPENAI_BASE_URL, OPENAI_API_KEY
reply = client.chat.completions.create(
    model=MODEL,
    messages=[{"role": "user", "content": "Say hello."}],
    max_tokens=MAX_TOKENS,
)
print(reply.choices[0].message.content)
