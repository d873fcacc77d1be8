"""Rebuild: what a previous run journaled but did not publish, rebuilt at start-up.

The journal holds every turn and rollout event since the last clean shutdown; the
shards hold what was published. `rebuild` reads the journal's frames, compares them
with the published shards by key (turn id and choice, rollout id and sample index,
rollout id) and returns exactly what is missing (`Rebuilt`): turns to write, sealed
rollouts to stitch again (with the samples or the rollout row already published left
out), and the rollouts that were still open, to be restored. The proxy takes it over
(`turnstile.proxy.core.Proxy.restore`); published rows are never written twice.

Retention (`turnstile.journal.retention`) removes a rollout's first frame only once the whole
rollout is published, so a rollout whose creation frame is gone is complete in the
shards: its remaining frames are checked turn by turn and it is not stitched again.
Everything handed back to the recorder is pinned to the frames it came from.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from turnstile.journal.codec import (
    CodecError,
    PolicyVersionSet,
    RewardsPosted,
    RolloutCreated,
    RolloutSealed,
    decode_event,
    rewards_from_event,
)
from turnstile.journal.wal import Journal
from turnstile.proxy.rollouts import Rollout
from turnstile.reader import open_output
from turnstile.records import Reward, RolloutStatus, TurnRecord

log = logging.getLogger("turnstile.rebuild")

# The journal's directory under the output directory (local disk, never object storage).
JOURNAL_DIR = "journal"


@dataclass(slots=True)
class RebuiltRollout:
    """One rollout's journaled events, gathered frame by frame."""

    rollout_id: str
    first_seq: int
    created: RolloutCreated | None = None
    rewards: dict[str, Reward] = field(default_factory=dict)
    turns: list[TurnRecord] = field(default_factory=list)
    sealed: RolloutSealed | None = None

    def rollout(self) -> Rollout:
        """The rollout these events describe, open or sealed as journaled."""
        created, sealed = self.created, self.sealed
        return Rollout(
            self.rollout_id,
            group_id=created.group_id if created else None,
            task_id=created.task_id if created else None,
            metadata=created.metadata if created else None,
            implicit=created.implicit if created else False,
            group_size=created.group_size if created else None,
            status=sealed.status if sealed else RolloutStatus.OPEN,
            rewards=dict(self.rewards),
            turns=sorted(self.turns, key=lambda t: (t.turn_index, t.choice_index)),
            next_turn_index=max((t.turn_index for t in self.turns), default=-1) + 1,
            created_at=created.created_at if created else time.time(),
            sealed_at=sealed.sealed_at if sealed else None,
            num_turns=len({t.turn_id for t in self.turns}),
            policy_versions={t.policy_version for t in self.turns},
            first_seq=self.first_seq,
        )


@dataclass(slots=True)
class Rebuilt:
    """What the journal holds that the shards do not."""

    frames: int = 0
    undecodable: int = 0
    policy_version: int | None = None
    policy_seq: int = 0
    unpublished_turns: list[TurnRecord] = field(default_factory=list)
    unpublished_first_seq: int | None = None
    retired_rollouts: int = 0  # published in full, their first frames already removed
    open_rollouts: list[RebuiltRollout] = field(default_factory=list)
    sealed_rollouts: list[RebuiltRollout] = field(default_factory=list)
    published_samples: set[tuple[str, int]] = field(default_factory=set)
    published_rollouts: set[str] = field(default_factory=set)

    def published_samples_of(self, rollout_id: str) -> frozenset[int]:
        """The sample indices of `rollout_id` already in published shards."""
        return frozenset(i for rid, i in self.published_samples if rid == rollout_id)

    def summary(self) -> str:
        """One line for the start-up log."""
        return (
            f"rebuilt from {self.frames} journal frames: {len(self.unpublished_turns)} turns "
            f"republished, {len(self.open_rollouts)} open rollouts restored, "
            f"{len(self.sealed_rollouts)} sealed rollouts re-stitched, "
            f"{self.retired_rollouts} already published, {self.undecodable} undecodable frames"
        )


def published_keys(output: Path) -> tuple[set[tuple[str, int]], set[tuple[str, int]], set[str]]:
    """What the shards under `output` hold: (turn_id, choice) keys of turns,
    (rollout_id, sample_index) keys of samples, and rollout ids; rows in the quarantine
    count as held (they are settled: writing them again would only quarantine them
    again)."""
    turn_keys, sample_keys, rollout_ids = _table_keys(output)
    held_turns, held_samples = quarantined_keys(output)
    return turn_keys | held_turns, sample_keys | held_samples, rollout_ids


def quarantined_keys(output: Path) -> tuple[set[tuple[str, int]], set[tuple[str, int]]]:
    """The (turn_id, choice) keys of quarantined turns and the (rollout_id, sample_index)
    keys of quarantined samples under `output`."""
    reader = open_output(output)
    if not reader.files("quarantine"):
        return set(), set()
    rows = reader.quarantine(
        columns=["table", "rollout_id", "turn_id", "choice_index", "sample_index"]
    ).to_pylist()
    turns = {
        (r["turn_id"], r["choice_index"])
        for r in rows
        if r["table"] == "turns" and r["turn_id"] is not None and r["choice_index"] is not None
    }
    samples = {
        (r["rollout_id"], r["sample_index"])
        for r in rows
        if r["table"] == "samples" and r["rollout_id"] is not None and r["sample_index"] is not None
    }
    return turns, samples


def _table_keys(output: Path) -> tuple[set[tuple[str, int]], set[tuple[str, int]], set[str]]:
    reader = open_output(output)
    turns = reader.turns(columns=["turn_id", "choice_index"]) if reader.files("turns") else None
    samples = (
        reader.samples(columns=["rollout_id", "sample_index"]) if reader.files("samples") else None
    )
    rollouts = reader.rollouts(columns=["rollout_id"]) if reader.files("rollouts") else None
    turn_keys = (
        set(zip(turns["turn_id"].to_pylist(), turns["choice_index"].to_pylist(), strict=True))
        if turns is not None
        else set()
    )
    sample_keys = (
        set(
            zip(samples["rollout_id"].to_pylist(), samples["sample_index"].to_pylist(), strict=True)
        )
        if samples is not None
        else set()
    )
    rollout_ids = set(rollouts["rollout_id"].to_pylist()) if rollouts is not None else set()
    return turn_keys, sample_keys, rollout_ids


def rebuild(journal: Journal, output: Path) -> Rebuilt:
    """Compare the frames of `journal` with the shards under `output`."""
    result = Rebuilt()
    rollouts: dict[str, RebuiltRollout] = {}
    frames = list(journal.frames())
    if not frames:
        return result
    turn_keys, sample_keys, rollout_ids = published_keys(output)
    result.published_samples, result.published_rollouts = sample_keys, rollout_ids
    seen_turns: set[tuple[str, int]] = set()
    for frame in frames:
        result.frames += 1
        try:
            event = decode_event(frame.kind, frame.payload)
        except CodecError as exc:
            result.undecodable += 1
            log.error("journal frame %d cannot be decoded: %s", frame.seq, exc)
            continue
        if isinstance(event, PolicyVersionSet):
            result.policy_version, result.policy_seq = event.policy_version, frame.seq
            continue
        state = rollouts.get(event.rollout_id)
        if state is None:
            state = rollouts[event.rollout_id] = RebuiltRollout(event.rollout_id, frame.seq)
        if isinstance(event, TurnRecord):
            key = (event.turn_id, event.choice_index)
            if key in seen_turns:
                continue
            seen_turns.add(key)
            state.turns.append(event)
            if key not in turn_keys:
                result.unpublished_turns.append(event)
                if result.unpublished_first_seq is None:
                    result.unpublished_first_seq = frame.seq
        elif isinstance(event, RolloutCreated):
            state.created = event
        elif isinstance(event, RewardsPosted):
            for reward in rewards_from_event(event):
                state.rewards[reward.name] = reward
        elif isinstance(event, RolloutSealed):
            state.sealed = event
    for state in rollouts.values():
        if state.created is None:
            result.retired_rollouts += 1
        elif state.sealed is None:
            result.open_rollouts.append(state)
        else:
            result.sealed_rollouts.append(state)
    return result
