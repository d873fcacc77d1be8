"""Stitching turns into samples: exact merges, and every break detected and classified."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import orjson

from turnstile.output.stitch import RolloutInfo, stitch
from turnstile.records import (
    BreakKind,
    Reward,
    RolloutStatus,
    Timings,
    TokenSource,
    TurnRecord,
    TurnStatus,
)

INFO = RolloutInfo("r1", "g1", "t1", RolloutStatus.FINISHED, [Reward("correct", 1.0)])


class CharTokenizer:
    """Decodes code points: enough to tell re-rendering from re-tokenization."""

    def decode(self, ids: object) -> str:
        return "".join(chr(int(i)) for i in ids)  # type: ignore[attr-defined]


def turn(
    index: int,
    prompt: list[int],
    completion: list[int],
    *,
    choice: int = 0,
    turn_id: str | None = None,
    messages: Sequence[Mapping[str, object]] | None = None,
    reply: Mapping[str, object] | None = None,
    status: TurnStatus = TurnStatus.OK,
    source: TokenSource = TokenSource.BACKEND,
    version: int = 0,
) -> TurnRecord:
    return TurnRecord(
        turn_id=turn_id or f"call-{index}",
        rollout_id="r1",
        turn_index=index,
        choice_index=choice,
        endpoint="chat.completions",
        model="m",
        policy_version=version,
        status=status,
        token_source=source,
        prompt_token_ids=np.asarray(prompt, dtype=np.int32),
        completion_token_ids=np.asarray(completion, dtype=np.int32),
        behavior_logprobs=np.asarray([-0.5 - i for i in range(len(completion))], np.float32),
        finish_reason="stop",
        stop_reason=None,
        request_messages_json=None if messages is None else orjson.dumps(messages).decode(),
        request_tools_json=None,
        request_prompt_json=None,
        response_message_json=None if reply is None else orjson.dumps(reply).decode(),
        response_text=None,
        sampling_params_json="{}",
        timings=Timings(0.0, 0.0, None, 0.0),
        http_status=200,
    )


def test_exact_multi_turn_merges_into_one_sample() -> None:
    t0 = turn(0, [1, 2, 3], [10, 11], version=3)
    t1 = turn(1, [1, 2, 3, 10, 11, 4, 5], [12], version=4)
    t2 = turn(2, [1, 2, 3, 10, 11, 4, 5, 12, 6], [13, 14], version=4)
    (sample,) = stitch(INFO, [t2, t0, t1])
    assert sample.input_ids.tolist() == [1, 2, 3, 10, 11, 4, 5, 12, 6, 13, 14]
    assert sample.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    lp = sample.behavior_logprobs
    assert np.isnan(lp[sample.loss_mask == 0]).all()
    assert lp[sample.loss_mask == 1].tolist() == [-0.5, -1.5, -0.5, -0.5, -1.5]
    assert sample.break_kind is BreakKind.FIRST and sample.parent_sample_index is None
    assert [(s.prompt_start, s.completion_start, s.completion_end) for s in sample.turn_spans] == [
        (0, 3, 5),
        (5, 7, 8),
        (8, 9, 11),
    ]
    assert sample.policy_versions == [3, 4, 4]
    assert sample.rewards == [Reward("correct", 1.0)]


def test_tokenization_drift_starts_a_new_sample() -> None:
    # "ab" sampled as [97, 98]; the next prompt re-tokenized it as one token 9000 == "ab"?
    # With a code-point decoder the same text with other IDs is a tokenization break.
    msgs = [{"role": "user", "content": "q"}]
    t0 = turn(0, [113], [97, 98], messages=msgs, reply={"role": "assistant", "content": "ab"})
    msgs1 = [*msgs, {"role": "assistant", "content": "ab"}, {"role": "user", "content": "r"}]

    class MergingTokenizer(CharTokenizer):
        def decode(self, ids: object) -> str:
            return "".join("ab" if int(i) == 9000 else chr(int(i)) for i in ids)  # type: ignore[attr-defined]

    t1 = turn(1, [113, 9000, 114], [99], messages=msgs1)
    first, second = stitch(INFO, [t0, t1], MergingTokenizer())
    assert first.input_ids.tolist() == [113, 97, 98]
    assert second.input_ids.tolist() == [113, 9000, 114, 99]
    assert second.break_kind is BreakKind.TOKENIZATION
    assert second.break_position == 1
    assert second.parent_sample_index == 0


def test_rerender_and_history_rewrite_are_told_apart() -> None:
    msgs: list[dict[str, object]] = [{"role": "user", "content": "q"}]
    reply: dict[str, object] = {"role": "assistant", "content": "ab"}
    t0 = turn(0, [113], [97, 98], messages=msgs, reply=reply)
    same: list[dict[str, object]] = [*msgs, reply, {"role": "user", "content": "r"}]
    rerendered = turn(1, [113, 97, 120, 114], [99], messages=same)
    _, s = stitch(INFO, [t0, rerendered], CharTokenizer())
    assert s.break_kind is BreakKind.RERENDER and s.break_position == 2

    rewritten: list[dict[str, object]] = [
        *msgs,
        {"role": "assistant", "content": "EDITED"},
        {"role": "user", "c": 1},
    ]
    t1 = turn(1, [113, 69], [99], messages=rewritten)
    _, s = stitch(INFO, [t0, t1], CharTokenizer())
    assert s.break_kind is BreakKind.HISTORY_REWRITTEN and s.break_position == 1


def test_unclassified_without_tokenizer_and_truncation() -> None:
    t0 = turn(0, [1, 2, 3], [4, 5])
    t1 = turn(1, [1, 2, 3, 4, 6, 7], [8])
    _, s = stitch(INFO, [t0, t1])
    assert s.break_kind is BreakKind.UNCLASSIFIED and s.break_position == 4
    t2 = turn(1, [1, 2], [9])
    _, s = stitch(INFO, [t0, t2])
    assert s.break_kind is BreakKind.TRUNCATED and s.break_position == 2


def test_retokenized_turns_never_merge() -> None:
    t0 = turn(0, [1, 2], [3])
    t1 = turn(1, [1, 2, 3, 4], [5], source=TokenSource.RETOKENIZED)
    first, second = stitch(INFO, [t0, t1])
    assert second.break_kind is BreakKind.TOKEN_SOURCE
    assert second.token_source is TokenSource.RETOKENIZED
    assert first.token_source is TokenSource.BACKEND


def test_sibling_choices_branch_and_the_continued_one_merges() -> None:
    a = turn(0, [1, 2], [3, 4], choice=0, turn_id="c0")
    b = turn(0, [1, 2], [5, 6], choice=1, turn_id="c0")
    nxt = turn(1, [1, 2, 5, 6, 7], [8])
    s0, s1 = stitch(INFO, [a, b, nxt])
    assert s0.input_ids.tolist() == [1, 2, 3, 4]
    assert s1.break_kind is BreakKind.BRANCH and s1.parent_sample_index == 0
    assert s1.input_ids.tolist() == [1, 2, 5, 6, 7, 8]
    assert s1.loss_mask.tolist() == [0, 0, 1, 1, 0, 1]


def test_error_turns_are_skipped_and_aborted_turns_get_no_loss() -> None:
    ok = turn(0, [1], [2])
    err = turn(1, [], [], status=TurnStatus.ERROR, source=TokenSource.NONE)
    cut = turn(2, [1, 2, 3], [4, 5], status=TurnStatus.ABORTED)
    (s,) = stitch(INFO, [ok, err, cut])
    assert s.input_ids.tolist() == [1, 2, 3, 4, 5]
    assert s.loss_mask.tolist() == [0, 1, 0, 0, 0]
    assert s.turn_statuses == ["ok", "aborted"]


def test_interleaved_subagents_continue_their_own_lineage() -> None:
    """A main agent and a subagent calling in turn on one rollout (Claude Code, opencode):
    each call continues the sample whose context it extends, not the previous call."""
    main, sub = [1, 2, 3], [7, 8]
    turns = []
    for i in range(3):
        turns.append(turn(2 * i, main, [10 + i]))
        main = [*main, 10 + i, 20 + i]
        turns.append(turn(2 * i + 1, sub, [30 + i]))
        sub = [*sub, 30 + i, 40 + i]
    samples = stitch(INFO, turns, CharTokenizer())
    assert len(samples) == 2
    assert [s.turn_index for s in samples[0].turn_spans] == [0, 2, 4]
    assert [s.turn_index for s in samples[1].turn_spans] == [1, 3, 5]
    assert samples[1].break_kind is not BreakKind.FIRST and samples[1].parent_sample_index == 0
