"""The `openai` client, asynchronous: a GRPO-style group of rollouts sampled concurrently.

python examples/openai_async.py
"""

from __future__ import annotations

import asyncio

import openai
from _common import MAX_TOKENS, MODEL, create_rollout, reward_and_finish

GROUP_SIZE = 4
PROMPT = "Name a prime number between 10 and 20."


async def one_rollout(index: int) -> str:
    rollout = await asyncio.to_thread(
        create_rollout, group_id="async-demo", task_id="primes", metadata={"member": index}
    )
    client = openai.AsyncOpenAI(
        base_url=rollout["base_url"], api_key=rollout["api_key"] or "unused"
    )
    reply = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS,
        temperature=1.0,
    )
    text = reply.choices[0].message.content or ""
    correct = float(any(p in text for p in ("11", "13", "17", "19")))
    await client.close()
    await asyncio.to_thread(reward_and_finish, rollout["rollout_id"], {"correct": correct})
    return str(rollout["rollout_id"])


async def main() -> None:
    ids = await asyncio.gather(*(one_rollout(i) for i in range(GROUP_SIZE)))
    print(f"finished {len(ids)} rollouts of group async-demo: {', '.join(ids)}")


if __name__ == "__main__":
    asyncio.run(main())
