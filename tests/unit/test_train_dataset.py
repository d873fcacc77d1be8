"""Following published shards: resumable positions, filters, complete GRPO groups."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from tests.unit.test_train_batches import group_records, record, write_shard
from turnstile.records import RolloutStatus
from turnstile.train.dataset import (
    GroupCollector,
    Position,
    ShardFollower,
    iter_group_batches,
    iter_groups,
    worker_shard_filter,
)

# A follower polls quickly in tests; a test waits at most this long for a published shard.
POLL_S = 0.05
WAIT_S = 20.0


def ids(samples: object) -> list[str]:
    return [s.rollout_id for s in samples]  # type: ignore[attr-defined]


def test_only_published_shards_are_read(tmp_path: Path) -> None:
    write_shard(tmp_path, group_records("a", [(1, 0), (0, 0)]))
    staging = tmp_path / ".tmp"
    staging.mkdir(exist_ok=True)
    (staging / "samples-part-0000000000001-w-000001.parquet.partial").write_bytes(b"partial")
    (tmp_path / "samples" / "notes.txt").write_text("not a shard")
    assert ids(ShardFollower(tmp_path)) == ["a-0", "a-1"]


def test_resume_from_a_saved_position_repeats_and_skips_nothing(tmp_path: Path) -> None:
    write_shard(tmp_path, group_records("a", [(1, 0)] * 3), writer="w1")
    write_shard(tmp_path, group_records("b", [(1, 0)] * 2), writer="w2")
    everything = ids(ShardFollower(tmp_path))
    assert len(everything) == 5
    for cut in range(6):
        follower = ShardFollower(tmp_path)
        it = iter(follower)
        first = [next(it).rollout_id for _ in range(cut)]
        saved = json.loads(json.dumps(follower.position.to_dict()))
        rest = ids(ShardFollower(tmp_path, position=saved))
        assert first + rest == everything


def test_status_version_and_staleness_filters(tmp_path: Path) -> None:
    recs = [
        record("old", "g", [1], [2], {"r": 1}, version=1),
        record("new", "g", [1], [2], {"r": 1}, version=4),
        record("cut", "g", [1], [2], {"r": 1}, version=4, status=RolloutStatus.INTERRUPTED),
    ]
    write_shard(tmp_path, recs)
    assert ids(ShardFollower(tmp_path)) == ["old", "new"]
    assert ids(ShardFollower(tmp_path, statuses=None)) == ["old", "new", "cut"]
    assert ids(ShardFollower(tmp_path, policy_version_min=2)) == ["new"]
    assert ids(ShardFollower(tmp_path, policy_version_max=2)) == ["old"]
    follower = ShardFollower(tmp_path, max_staleness=1, current_version=lambda: 5)
    assert ids(follower) == ["new"]
    assert (follower.stats.dropped_stale, follower.stats.dropped_status) == (1, 1)
    with pytest.raises(ValueError):
        ShardFollower(tmp_path, max_staleness=1)


def test_follow_picks_up_shards_published_later(tmp_path: Path) -> None:
    follower = ShardFollower(tmp_path, follow=True, poll_interval_s=POLL_S, idle_timeout_s=WAIT_S)
    seen: list[str] = []

    def consume() -> None:
        for s in follower:
            seen.append(s.rollout_id)
            if len(seen) == 4:
                follower.stop()

    thread = threading.Thread(target=consume)
    thread.start()
    write_shard(tmp_path, group_records("a", [(1, 0), (0, 0)]), writer="w1")
    time.sleep(3 * POLL_S)
    write_shard(tmp_path, group_records("b", [(1, 0), (0, 0)]), writer="w2")
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert seen == ["a-0", "a-1", "b-0", "b-1"]


def test_follow_ends_after_the_idle_timeout(tmp_path: Path) -> None:
    started = time.monotonic()
    follower = ShardFollower(tmp_path, follow=True, poll_interval_s=POLL_S, idle_timeout_s=0.2)
    assert list(follower) == []
    assert time.monotonic() - started < WAIT_S


def test_groups_wait_until_complete(tmp_path: Path) -> None:
    a = group_records("a", [(1, 0)] * 3)
    b = group_records("b", [(0, 1)] * 3)
    write_shard(tmp_path, [a[0], b[0], a[1], b[1]], writer="w1")
    write_shard(tmp_path, [b[2], a[2]], writer="w2")
    groups = list(iter_groups(ShardFollower(tmp_path), 3))
    assert [ids(g) for g in groups] == [["b-0", "b-1", "b-2"], ["a-0", "a-1", "a-2"]]
    batch = list(iter_group_batches(ShardFollower(tmp_path), 3, 2))
    assert len(batch) == 1 and len(batch[0]) == 6
    collector = GroupCollector(3, max_open_groups=1)
    collector.add(ShardFollower(tmp_path).__iter__().__next__())
    assert collector.open_groups == 1
    lone = record("solo", None, [1], [2], {"r": 1})
    write_shard(tmp_path / "solo", [lone])
    assert [ids(g) for g in iter_groups(ShardFollower(tmp_path / "solo"), 1)] == [["solo"]]
    with pytest.raises(ValueError):
        GroupCollector(0)


def test_open_groups_are_bounded(tmp_path: Path) -> None:
    collector = GroupCollector(2, max_open_groups=2)
    for g in "abc":
        write_shard(tmp_path / g, [record(f"{g}-0", g, [1], [2], {"r": 1})])
        for s in ShardFollower(tmp_path / g):
            assert collector.add(s) == []
    assert (collector.open_groups, collector.dropped_groups) == (2, 1)


def test_worker_filters_split_shards(tmp_path: Path) -> None:
    for w in range(6):
        write_shard(tmp_path, group_records(f"g{w}", [(1, 0)]), writer=f"w{w}")
    parts = [ids(ShardFollower(tmp_path, shard_filter=worker_shard_filter(i, 2))) for i in range(2)]
    assert sorted(parts[0] + parts[1]) == sorted(ids(ShardFollower(tmp_path)))
    assert not set(parts[0]) & set(parts[1])


def test_position_round_trip_and_uri_paths(tmp_path: Path) -> None:
    p = Position({"x", "y"}, "z", 3)
    assert Position.from_dict(p.to_dict()) == p
    assert Position.from_dict(None) == Position()
    write_shard(tmp_path, group_records("a", [(1, 0)]))
    assert ids(ShardFollower(f"file://{tmp_path}")) == ["a-0"]


def test_iterable_dataset_yields_samples_groups_and_resumes(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    from turnstile.train.torchdata import ShardIterableDataset

    write_shard(tmp_path, group_records("a", [(1, 0)] * 2), writer="w1")
    write_shard(tmp_path, group_records("b", [(1, 0)] * 2), writer="w2")
    ds = ShardIterableDataset(tmp_path)
    it = iter(ds)
    assert next(it).rollout_id == "a-0"
    resumed = ShardIterableDataset(tmp_path, position=ds.state_dict())
    assert ids(resumed) == ["a-1", "b-0", "b-1"]
    grouped = ShardIterableDataset(tmp_path, group_size=2)
    assert [ids(g) for g in grouped] == [["a-0", "a-1"], ["b-0", "b-1"]]
    loader = DataLoader(ShardIterableDataset(tmp_path), batch_size=None, collate_fn=lambda x: x)
    assert sorted(ids(loader)) == ["a-0", "a-1", "b-0", "b-1"]


def test_stale_tokens_are_masked_or_samples_split_by_version(tmp_path: Path) -> None:
    from tests.unit.test_train_batches import _two_version_record

    write_shard(tmp_path, [_two_version_record("a"), record("old", "g", [1], [2], {}, version=1)])
    # drop (the default): the oldest turn decides for the whole sample
    dropped = ShardFollower(tmp_path, max_staleness=1, current_version=lambda: 6)
    assert ids(dropped) == [] and dropped.stats.dropped_stale == 2
    # mask: the fresh tokens stay in the loss; a sample with none left is dropped
    masked = ShardFollower(tmp_path, max_staleness=1, current_version=lambda: 6, stale="mask")
    (a,) = list(masked)
    assert a.loss_mask.tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert (masked.stats.masked_stale_tokens, masked.stats.dropped_stale) == (4, 1)
    # split: one sample per version, then the staleness rule applies to each piece
    split = ShardFollower(tmp_path, split_versions=True)
    assert [(s.rollout_id, s.min_policy_version) for s in split] == [
        ("a", 2),
        ("a", 5),
        ("old", 1),
    ]
    assert split.stats.split_samples == 1
    fresh = ShardFollower(tmp_path, split_versions=True, max_staleness=1, current_version=lambda: 6)
    assert [(s.rollout_id, s.min_policy_version) for s in fresh] == [("a", 5)]
    with pytest.raises(ValueError, match="stale"):
        ShardFollower(tmp_path, stale="keep")  # type: ignore[arg-type]


def test_a_resume_between_the_pieces_of_a_split_sample_repeats_and_skips_nothing(
    tmp_path: Path,
) -> None:
    from tests.unit.test_train_batches import _two_version_record

    write_shard(tmp_path, [_two_version_record("a"), _two_version_record("b")], writer="w1")
    write_shard(tmp_path, group_records("c", [(1, 0)]), writer="w2")
    everything = [
        (s.rollout_id, s.min_policy_version) for s in ShardFollower(tmp_path, split_versions=True)
    ]
    assert everything == [("a", 2), ("a", 5), ("b", 2), ("b", 5), ("c-0", 0)]
    for cut in range(len(everything) + 1):
        follower = ShardFollower(tmp_path, split_versions=True)
        it = iter(follower)
        first = [(s.rollout_id, s.min_policy_version) for s in (next(it) for _ in range(cut))]
        saved = json.loads(json.dumps(follower.position.to_dict()))
        rest = [
            (s.rollout_id, s.min_policy_version)
            for s in ShardFollower(tmp_path, split_versions=True, position=saved)
        ]
        assert first + rest == everything, cut
