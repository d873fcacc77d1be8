"""`python -m turnstile.bench.stitching`: the writer's stitching cost as rollouts grow.

Times `turnstile.output.stitch.stitch` (the writer thread's work per sealed rollout) on
synthetic rollouts: one call with n choices followed by a call continuing the first,
and a conversation of n calls that breaks on every call (record mode on a template that
re-renders history). Each size is run `--repeats` times and the median is printed with
the time per choice or per call and per thousand recorded tokens (the rollout's size:
its prompts and completions), so growth that is not linear in the rollout's size shows
as a rising per-token figure. Only the public `stitch` function is used, so the same script times
any version of the package (`PYTHONPATH=<tree> python -m turnstile.bench.stitching`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import numpy as np

from turnstile.output.stitch import RolloutInfo, stitch
from turnstile.records import (
    Reward,
    RolloutStatus,
    Timings,
    TokenSource,
    TurnRecord,
    TurnStatus,
)

INFO = RolloutInfo("r", None, None, RolloutStatus.FINISHED, [Reward("r", 1.0)])
PROMPT_TOKENS = 2000  # an agent's system prompt and tools
COMPLETION_TOKENS = 50


class _Detokenizer:
    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(map(str, ids))


def _turn(index: int, choice: int, prompt: np.ndarray, completion: np.ndarray) -> TurnRecord:
    return TurnRecord(
        turn_id=f"call-{index}",
        rollout_id="r",
        turn_index=index,
        choice_index=choice,
        endpoint="chat.completions",
        model="m",
        policy_version=0,
        status=TurnStatus.OK,
        token_source=TokenSource.BACKEND,
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        behavior_logprobs=np.full(len(completion), -0.5, dtype=np.float32),
        finish_reason="stop",
        stop_reason=None,
        request_messages_json=None,
        request_tools_json=None,
        request_prompt_json=None,
        response_message_json=None,
        response_text=None,
        sampling_params_json="{}",
        timings=Timings(0.0, 0.0, None, 0.0),
        http_status=200,
    )


def choices(n: int) -> list[TurnRecord]:
    """One call with `n` choices, then a call that continues choice 0."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 150_000, PROMPT_TOKENS, dtype=np.int32)
    made = [
        _turn(0, i, prompt, rng.integers(0, 150_000, COMPLETION_TOKENS, dtype=np.int32))
        for i in range(n)
    ]
    follow = np.concatenate([prompt, made[0].completion_token_ids, prompt[:20]])
    return [*made, _turn(1, 0, follow, prompt[:COMPLETION_TOKENS])]


def breaking_calls(n: int) -> list[TurnRecord]:
    """`n` calls, each re-rendering the last completion differently (a break per call)."""
    rng = np.random.default_rng(0)
    context = rng.integers(0, 150_000, PROMPT_TOKENS, dtype=np.int32)
    out = []
    for i in range(n):
        completion = rng.integers(0, 150_000, COMPLETION_TOKENS, dtype=np.int32)
        out.append(_turn(i, 0, context, completion))
        rerendered = rng.integers(0, 150_000, COMPLETION_TOKENS + 20, dtype=np.int32)
        context = np.concatenate([context, rerendered])
    return out


def _time(turns: list[TurnRecord], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        stitch(INFO, turns, _Detokenizer())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--choices", type=int, nargs="+", default=[500, 1000, 2000, 10000])
    parser.add_argument("--calls", type=int, nargs="+", default=[100, 200, 400])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print("| rollout | n | recorded tokens | stitch (median) | per item | per 1k tokens |")
    print("|---|---|---|---|---|---|")
    for label, make, sizes in (
        ("n choices", choices, args.choices),
        ("n calls, a break each", breaking_calls, args.calls),
    ):
        for n in sizes:
            turns = make(n)
            size = sum(len(t.prompt_token_ids) + len(t.completion_token_ids) for t in turns)
            seconds = _time(turns, args.repeats)
            print(
                f"| {label} | {n} | {size:,} | {seconds * 1e3:.1f} ms "
                f"| {seconds / n * 1e6:.0f} us | {seconds / size * 1e9:.0f} us |"
            )


if __name__ == "__main__":
    main()
