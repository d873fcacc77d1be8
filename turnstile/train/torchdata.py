"""``ShardIterableDataset``: a ``torch.utils.data.IterableDataset`` over published shards.

It wraps ``turnstile.train.dataset.ShardFollower`` (follow new shards, resume from a
position, filter by status, policy version and staleness). With ``group_size`` it yields
complete GRPO groups (lists of ``TrainSample``) instead of single samples. Under a
``DataLoader`` with several workers, each worker reads a disjoint set of shards; the
position is then per worker, so resume with ``num_workers=0`` or one dataset per worker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from torch.utils.data import IterableDataset, get_worker_info

from turnstile.train.dataset import (
    DEFAULT_POLL_INTERVAL_S,
    Position,
    ShardFollower,
    iter_groups,
    worker_shard_filter,
)


class ShardIterableDataset(IterableDataset[Any]):
    """Samples (or complete groups) from Turnstile shards, following new ones if asked."""

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        *,
        group_size: int | None = None,
        statuses: Sequence[str] | None = ("finished",),
        policy_version_min: int | None = None,
        policy_version_max: int | None = None,
        max_staleness: int | None = None,
        current_version: Callable[[], int] | None = None,
        stale: Literal["drop", "mask"] = "drop",
        split_versions: bool = False,
        follow: bool = False,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        idle_timeout_s: float | None = None,
        position: Position | dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.paths = paths
        self.group_size = group_size
        self.kwargs: dict[str, Any] = dict(
            statuses=statuses,
            policy_version_min=policy_version_min,
            policy_version_max=policy_version_max,
            max_staleness=max_staleness,
            current_version=current_version,
            stale=stale,
            split_versions=split_versions,
            follow=follow,
            poll_interval_s=poll_interval_s,
            idle_timeout_s=idle_timeout_s,
        )
        self.position = position if isinstance(position, Position) else Position.from_dict(position)
        self.follower: ShardFollower | None = None

    def state_dict(self) -> dict[str, Any]:
        """The position reached (JSON-able); pass it as ``position`` to resume."""
        return self.position.to_dict()

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        shard_filter = None if info is None else worker_shard_filter(info.id, info.num_workers)
        self.follower = ShardFollower(
            self.paths, position=self.position, shard_filter=shard_filter, **self.kwargs
        )
        if self.group_size is None:
            return iter(self.follower)
        return iter_groups(self.follower, self.group_size)

    def stop(self) -> None:
        if self.follower is not None:
            self.follower.stop()
