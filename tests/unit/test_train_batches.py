"""Training samples from real shards: padded and packed batches, advantages on samples."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from turnstile.output.shards import ParquetShardSink
from turnstile.reader import open_output
from turnstile.records import BreakKind, Reward, RolloutStatus, SampleRecord, TokenSource, TurnSpan
from turnstile.train import batches
from turnstile.train.dataset import ShardFollower

IDENTITY = {"turnstile.model": "tiny", "turnstile.tokenizer": "tiny"}


def record(
    rollout_id: str,
    group_id: str | None,
    prompt: Sequence[int],
    completion: Sequence[int],
    rewards: dict[str, float],
    version: int = 0,
    info: dict[str, str] | None = None,
    status: RolloutStatus = RolloutStatus.FINISHED,
) -> SampleRecord:
    """A one-turn sample as the stitcher makes it."""
    ids = np.array([*prompt, *completion], dtype=np.int32)
    mask = np.array([0] * len(prompt) + [1] * len(completion), dtype=np.int8)
    logp = np.where(mask > 0, -1.0 - 0.01 * np.arange(ids.size), np.nan).astype(np.float32)
    return SampleRecord(
        rollout_id=rollout_id,
        sample_index=0,
        group_id=group_id,
        task_id="t",
        input_ids=ids,
        loss_mask=mask,
        behavior_logprobs=logp,
        turn_spans=[TurnSpan(0, 0, 0, len(prompt), ids.size)],
        rewards=[Reward(k, v, (info or {}).get(k)) for k, v in rewards.items()],
        policy_versions=[version],
        token_source=TokenSource.BACKEND,
        rollout_status=status,
        break_kind=BreakKind.FIRST,
        break_position=None,
        break_detail=None,
        parent_sample_index=None,
        turn_statuses=["ok"],
    )


def write_shard(output: Path, records: Sequence[SampleRecord], writer: str = "w") -> None:
    """Publish ``records`` as one samples shard, the way the proxy does."""
    sink = ParquetShardSink(output, writer_id=writer, identity=IDENTITY, fsync=False)
    sink.write_samples(list(records))
    sink.close()


def group_records(
    group: str,
    rewards: Sequence[tuple[float, float]],
    version: int = 0,
    lengths: Sequence[int] | None = None,
) -> list[SampleRecord]:
    lengths = lengths or [3] * len(rewards)
    return [
        record(
            f"{group}-{i}",
            group,
            [1, 2],
            list(range(10, 10 + n)),
            {"correct": r[0], "format": r[1]},
            version,
            info={"correct": f"verdict {i}"},
        )
        for i, (r, n) in enumerate(zip(rewards, lengths, strict=True))
    ]


def load(output: Path) -> list[batches.TrainSample]:
    return list(ShardFollower(output))


def test_samples_read_back_exactly(tmp_path: Path) -> None:
    recs = group_records("g", [(1, 0), (0, 1)], version=3)
    write_shard(tmp_path, recs)
    samples = load(tmp_path)
    assert [s.rollout_id for s in samples] == ["g-0", "g-1"]
    s = samples[0]
    assert s.input_ids.tolist() == [1, 2, 10, 11, 12]
    assert s.loss_mask.tolist() == [0, 0, 1, 1, 1]
    assert np.isnan(s.behavior_logprobs[:2]).all()
    np.testing.assert_allclose(s.behavior_logprobs[2:], recs[0].behavior_logprobs[2:])
    assert s.rewards == {"correct": 1.0, "format": 0.0}
    assert s.reward_info == {"correct": "verdict 0", "format": None}
    assert (s.min_policy_version, s.max_policy_version, s.staleness(5)) == (3, 3, 2)


def test_pad_batch_aligns_everything_with_the_mask(tmp_path: Path) -> None:
    write_shard(
        tmp_path, group_records("g", [(1, 0), (1, 0), (0, 1), (0, 0)], lengths=[1, 2, 3, 4])
    )
    samples = load(tmp_path)
    a = batches.assign_grpo(samples, ["correct", "format"])
    np.testing.assert_allclose(a, [0.5, 0.5, 0.5, -1.5], atol=1e-3)
    b = batches.pad_batch(samples, pad_token_id=7, pad_to_multiple_of=4)
    assert b["input_ids"].shape == (4, 8)
    assert b["input_ids"][0].tolist() == [1, 2, 10, 7, 7, 7, 7, 7]
    assert b["attention_mask"].sum(1).tolist() == [3, 4, 5, 6]
    assert b["loss_mask"].sum(1).tolist() == [1, 2, 3, 4]
    assert b["position_ids"][3].tolist() == [0, 1, 2, 3, 4, 5, 0, 0]
    assert np.isfinite(b["behavior_logprobs"]).all()
    assert (b["behavior_logprobs"][b["loss_mask"] == 0] == 0).all()
    assert (b["advantages"][b["loss_mask"] == 0] == 0).all()
    np.testing.assert_allclose(b["advantages"][3, 2:6], [-1.5] * 4, atol=1e-3)
    assert b["group_index"].tolist() == [0, 0, 0, 0]
    assert b["policy_version"].tolist() == [0, 0, 0, 0]
    truncated = batches.pad_batch(samples, max_length=4)
    assert truncated["input_ids"].shape == (4, 4)


def test_pack_batch_restarts_positions_and_marks_boundaries(tmp_path: Path) -> None:
    write_shard(tmp_path, group_records("g", [(1, 1), (0, 1)], lengths=[1, 3]))
    samples = load(tmp_path)
    batches.assign_gdpo(samples)
    p = batches.pack_batch(samples)
    assert p["input_ids"].tolist() == [[1, 2, 10, 1, 2, 10, 11, 12]]
    assert p["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert p["cu_seqlens"].tolist() == [0, 3, 8]
    assert p["sequence_index"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 1]]
    assert p["loss_mask"].tolist() == [[0, 0, 1, 0, 0, 1, 1, 1]]
    assert p["advantages"][0, 2] > 0 > p["advantages"][0, 5]
    with pytest.raises(ValueError):
        batches.pack_batch(samples, max_tokens=5)
    packs = batches.pack_greedy(samples * 3, max_tokens=8)
    assert [len(pk) for pk in packs] == [2, 2, 2]


def test_mrtpo_on_samples_uses_relevance_and_keeps_the_total(tmp_path: Path) -> None:
    write_shard(
        tmp_path, group_records("g", [(1, 0), (1, 0), (0, 1), (0, 0)], lengths=[4, 4, 4, 4])
    )
    samples = load(tmp_path)
    relevance = {
        ("g-0", 0, "correct"): np.array([0.01, 0.30, 0.05, 0.04]),
        ("g-0", 0, "format"): np.array([0.20, 0.01, 0.01, 0.18]),
    }
    tokens = batches.assign_mrtpo(samples, relevance, ["correct", "format"])
    gdpo = batches.assign_gdpo(load(tmp_path), ["correct", "format"])
    for i, t in enumerate(tokens):
        assert t.sum() == pytest.approx(4 * gdpo[i], abs=1e-6)
    assert samples[0].advantages is not None
    assert np.argmax(samples[0].advantages) == 3  # the token the `correct` verifier cares about
    np.testing.assert_allclose(tokens[1], [gdpo[1]] * 4, atol=1e-9)  # no relevance: uniform


def test_to_torch_converts_every_array(tmp_path: Path) -> None:
    import torch

    write_shard(tmp_path, group_records("g", [(1, 0), (0, 1)]))
    t = batches.to_torch(batches.pad_batch(load(tmp_path)))
    assert t["input_ids"].dtype == torch.int64 and t["advantages"].dtype == torch.float32
    assert tuple(t["loss_mask"].shape) == (2, 5)


def sample(
    rollout: str,
    index: int,
    group: str,
    mask: Sequence[int],
    rewards: dict[str, float],
) -> batches.TrainSample:
    """A sample of a (possibly split) rollout; ``mask`` may have several masked spans."""
    n = len(mask)
    return batches.TrainSample(
        rollout_id=rollout,
        sample_index=index,
        group_id=group,
        task_id="t",
        rollout_status="finished",
        input_ids=np.arange(n, dtype=np.int32) + 5,
        loss_mask=np.array(mask, dtype=np.int8),
        behavior_logprobs=np.full(n, -1.0, dtype=np.float32),
        rewards=dict(rewards),
        reward_info={},
        policy_versions=np.zeros(1, dtype=np.int64),
        min_policy_version=0,
        max_policy_version=0,
    )


def test_a_split_rollout_counts_once_in_its_group() -> None:
    # rollout A (reward 1) split into two samples, rollout B (reward 0): +-1/sqrt(2), not
    # the per-sample [0.577, 0.577, -1.155]
    samples = [
        sample("A", 0, "g", [0, 1, 1], {"r": 1.0}),
        sample("A", 1, "g", [0, 0, 1, 1], {"r": 1.0}),
        sample("B", 0, "g", [0, 1, 1], {"r": 0.0}),
    ]
    half = 1 / math.sqrt(2)
    np.testing.assert_allclose(batches.assign_grpo(samples), [half, half, -half], atol=1e-6)
    assert samples[1].advantages is not None
    np.testing.assert_allclose(samples[1].advantages, [0, 0, half, half], atol=1e-6)
    # GDPO (both variants) and its batch normalisation run over rollouts as well
    two = [
        sample("A", 0, "g", [1], {"x": 1.0, "y": 0.0}),
        sample("A", 1, "g", [1], {"x": 1.0, "y": 0.0}),
        sample("B", 0, "g", [1], {"x": 0.0, "y": 1.0}),
        sample("C", 0, "h", [1], {"x": 0.0, "y": 0.0}),
        sample("D", 0, "h", [1], {"x": 1.0, "y": 1.0}),
    ]
    # per rollout, before batch norm: A, B = +-(2 * 0.7071) / ... : A: +0.7071 - 0.7071 = 0,
    # B: 0; C: -1.4142, D: +1.4142 (eps 1e-4 aside) -> batch-normalised over 4 values
    got = batches.assign_gdpo(two)
    sums = np.array([0.0, 0.0, -2 / (math.sqrt(0.5) + 1e-4), 2 / (math.sqrt(0.5) + 1e-4)])
    sums *= 0.5  # (x - mean) over std + eps, for each of the two rewards: +-0.5 / 0.7072
    expected = (sums - sums.mean()) / (sums.std(ddof=1) + 1e-4)
    np.testing.assert_allclose(got, expected[[0, 0, 1, 2, 3]], atol=1e-9)
    with pytest.raises(ValueError):
        batches.assign_grpo([sample("A", 0, "g", [1], {"r": 1.0}), sample("A", 1, "g", [1], {})])


def test_mrtpo_on_a_split_multi_turn_rollout_keeps_per_reward_totals() -> None:
    # rollout A: two samples, the first with two masked spans (multi-turn), 5 loss tokens
    a0 = sample("A", 0, "g", [0, 1, 1, 0, 0, 1, 0], {"x": 1.0, "y": 1.0})
    a1 = sample("A", 1, "g", [0, 0, 1, 0, 1], {"x": 1.0, "y": 1.0})
    b = sample("B", 0, "g", [0, 1, 1, 1], {"x": 0.0, "y": 0.0})
    relevance = {
        ("A", 0, "x"): np.array([0.1, 0.0, 0.3]),
        ("A", 1, "x"): np.array([0.0, 0.1]),
        ("A", 0, "y"): np.array([0.2, 0.2, 0.2]),
        ("A", 1, "y"): np.array([0.2, 0.2]),
    }
    tokens = batches.assign_mrtpo([a0, a1, b], relevance, floor=1.0, max_weight=None)
    # per reward over A's 5 tokens: x weights 5 * d / 0.5 = [1, 0, 3, 0, 1], y uniform;
    # GDPO per reward for (A, B): x and y both +0.7071 / -0.7071 (eps 1e-4)
    ax = ay = 0.5 / (math.sqrt(0.5) + 1e-4)
    raw_a = ax * np.array([1, 0, 3, 0, 1]) + ay * np.ones(5)
    # batch normalisation over the rollouts' sums (A: ax + ay, B: -(ax + ay))
    total = np.array([ax + ay, -ax - ay])
    mean, std = total.mean(), total.std(ddof=1)
    np.testing.assert_allclose(
        np.concatenate([tokens[0], tokens[1]]), (raw_a - mean) / (std + 1e-4)
    )
    # the rollout's total is its length times its GDPO advantage (before batch norm)
    before = np.concatenate([tokens[0], tokens[1]]) * (std + 1e-4) + mean
    assert before.sum() == pytest.approx(5 * (ax + ay))
    # loss_mask alignment: the token advantages sit on the masked positions, in order
    assert a0.advantages is not None and a1.advantages is not None
    assert np.flatnonzero(a0.advantages).tolist() == [1, 2, 5]
    np.testing.assert_allclose(a0.advantages[[1, 2, 5]], tokens[0])
    np.testing.assert_allclose(a1.advantages[[2, 4]], tokens[1])
    assert a1.advantages[[0, 1, 3]].tolist() == [0, 0, 0]
    # a sample of the rollout without relevance: its tokens are unknown (weight 1)
    del relevance[("A", 1, "x")]
    tokens = batches.assign_mrtpo(
        [a0, a1, b], relevance, floor=1.0, max_weight=None, weights=[1.0, 0.0]
    )
    # x over A: known [0.1, 0, 0.3] share 3 tokens: 3 * d / 0.4; unknown two get 1
    # (batch sums now +-ax)
    std = float(np.std([ax, -ax], ddof=1))
    np.testing.assert_allclose(
        np.concatenate([tokens[0], tokens[1]]) * (std + 1e-4),
        ax * np.array([0.75, 0.0, 2.25, 1.0, 1.0]),
    )
    with pytest.raises(ValueError):
        batches.assign_mrtpo([a0], {("A", 0, "x"): np.zeros(4)})


def test_batches_carry_the_rollout_order() -> None:
    samples = [
        sample("A", 0, "g", [0, 1], {"r": 1.0}),
        sample("B", 0, "g", [0, 1], {"r": 0.0}),
        sample("A", 1, "g", [0, 1], {"r": 1.0}),
    ]
    for b in (batches.pad_batch(samples), batches.pack_batch(samples)):
        assert b["rollout_index"].tolist() == [0, 1, 0]
        assert b["sample_index"].tolist() == [0, 0, 1]


def _two_version_record(rollout_id: str) -> SampleRecord:
    """A sample whose 6 sampled tokens came from version 2 (3 tokens), then version 5."""
    rec = record(rollout_id, "g", [1, 2], [10, 11, 12, 13, 14, 15], {"correct": 1.0}, 2)
    rec.policy_version_spans = [(2, 2), (5, 5)]
    return rec


def test_per_token_versions_are_read_back_and_laid_out(tmp_path: Path) -> None:
    write_shard(tmp_path, [_two_version_record("a"), record("b", "g", [1], [9, 8], {}, 4)])
    a, b = load(tmp_path)
    assert a.token_versions().tolist() == [-1, -1, 2, 2, 2, 5, 5, 5]
    assert a.token_staleness(6).tolist() == [0, 0, 4, 4, 4, 1, 1, 1]
    assert b.token_versions().tolist() == [-1, 4, 4]  # no spans written: the turn's version
    padded = batches.pad_batch([a, b])
    assert padded["behavior_versions"].tolist() == [
        [-1, -1, 2, 2, 2, 5, 5, 5],
        [-1, 4, 4, -1, -1, -1, -1, -1],
    ]
    packed = batches.pack_batch([a, b])
    assert packed["behavior_versions"][0].tolist() == [-1, -1, 2, 2, 2, 5, 5, 5, -1, 4, 4]
    arrays = list(open_output(tmp_path).sample_arrays())  # the reader gives them too
    assert [x["behavior_versions"].tolist() for x in arrays] == [
        [-1, -1, 2, 2, 2, 5, 5, 5],
        [-1, 4, 4],
    ]


def test_stale_tokens_leave_the_loss_token_by_token(tmp_path: Path) -> None:
    write_shard(tmp_path, [_two_version_record("a")])
    (a,) = load(tmp_path)
    a.advantages = np.where(a.loss_mask > 0, 1.0, 0.0)
    assert batches.mask_stale_tokens([a], current_version=6, max_staleness=1) == 3
    assert a.loss_mask.tolist() == [0, 0, 0, 0, 0, 1, 1, 1]  # version 2 is 4 behind
    assert a.advantages.tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert a.token_versions().tolist() == [-1, -1, -1, -1, -1, 5, 5, 5]
    assert batches.mask_stale_tokens([a], current_version=6, max_staleness=1) == 0
    assert batches.mask_stale_tokens([a], current_version=7, max_staleness=2) == 0
    assert batches.mask_stale_tokens([a], current_version=7, max_staleness=1) == 3
    assert a.num_loss_tokens == 0
    with pytest.raises(ValueError, match="max_staleness"):
        batches.mask_stale_tokens([a], 7, -1)


def test_a_sample_that_straddled_an_update_splits_into_one_per_version(tmp_path: Path) -> None:
    write_shard(tmp_path, [_two_version_record("a"), record("b", "g", [1], [9, 8], {}, 4)])
    a, b = load(tmp_path)
    a.advantages = np.where(a.loss_mask > 0, 0.5, 0.0)
    old, new = batches.split_at_version_changes(a)
    # The version-2 piece: the context up to its last token, its own tokens in the loss.
    assert old.input_ids.tolist() == a.input_ids[:5].tolist()
    assert old.loss_mask.tolist() == [0, 0, 1, 1, 1]
    assert old.token_versions().tolist() == [-1, -1, 2, 2, 2]
    np.testing.assert_array_equal(old.behavior_logprobs, a.behavior_logprobs[:5])
    assert (old.min_policy_version, old.max_policy_version) == (2, 2)
    # The version-5 piece: the whole context, version 2's tokens as context only.
    assert new.input_ids.tolist() == a.input_ids.tolist()
    assert new.loss_mask.tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert new.token_versions().tolist() == [-1, -1, -1, -1, -1, 5, 5, 5]
    assert new.advantages is not None and new.advantages.tolist() == [0, 0, 0, 0, 0] + [0.5] * 3
    assert (new.min_policy_version, new.max_policy_version) == (5, 5)
    assert old.num_loss_tokens + new.num_loss_tokens == a.num_loss_tokens
    assert batches.split_at_version_changes(b) == [b]  # one version: unchanged
