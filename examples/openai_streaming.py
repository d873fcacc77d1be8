"""The `openai` client with `stream=True`: tokens are relayed as they come and recorded.

python examples/openai_streaming.py
"""

from __future__ import annotations

import openai
from _common import MAX_TOKENS, MODEL, create_rollout, reward_and_finish


def main() -> None:
    rollout = create_rollout(group_id="stream-demo")
    client = openai.OpenAI(base_url=rollout["base_url"], api_key=rollout["api_key"] or "unused")
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write a haiku about tokens."}],
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    pieces = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
    text = "".join(pieces)
    lines = [line for line in text.splitlines() if line.strip()]
    summary = reward_and_finish(rollout["rollout_id"], {"three_lines": float(len(lines) == 3)})
    print(f"rollout {rollout['rollout_id']}: {summary['status']}, {len(pieces)} chunks")


if __name__ == "__main__":
    main()
