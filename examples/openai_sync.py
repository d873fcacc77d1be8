"""The `openai` client, synchronous: a two-turn conversation recorded as one rollout.

python examples/openai_sync.py
"""

from __future__ import annotations

from typing import Any

import openai
from _common import MAX_TOKENS, MODEL, create_rollout, reward_and_finish


def main() -> None:
    rollout = create_rollout(group_id="sync-demo", task_id="arith-1")
    client = openai.OpenAI(base_url=rollout["base_url"], api_key=rollout["api_key"] or "unused")
    messages: list[Any] = [{"role": "user", "content": "What is 2+2?"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS)
    answer = reply.choices[0].message.content or ""
    messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Are you sure? Answer with a number."},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS)
    final = reply.choices[0].message.content or ""
    summary = reward_and_finish(
        rollout["rollout_id"],
        {"correct": float("4" in final)},
        {"correct": f"final answer: {final!r}"},
    )
    print(f"rollout {rollout['rollout_id']}: {summary['status']}, rewards {summary['rewards']}")


if __name__ == "__main__":
    main()
