"""Recovery: what a previous run journaled but did not publish, rebuilt at start-up.

The journal holds every turn and rollout event since the last clean shutdown; the
shards hold what was published. Recovery replays the journal, compares it with the
published shards by key (turn id and choice, rollout id and sample index, rollout id)
and returns exactly what is missing: turns to write, sealed rollouts to stitch again
(with the samples or the rollout row already published left out), and the rollouts
that were still open, to be restored. Published rows are never written twice.

Retention (`turnstile.journal.retention`) removes a rollout's first frame only once the whole
rollout is published, so a rollout whose creation frame is gone is complete in the
shards: its remaining frames are checked turn by turn and it is not stitched again.
Everything handed back to the recorder is pinned to the frames it came from.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from turnstile.proxy.core import Proxy

log = logging.getLogger("turnstile.recovery")

# The journal's directory under the output directory (local disk, never object storage).
JOURNAL_DIR = "journal"


@dataclass(slots=True)
class RecoveredRollout:
    rollout_id: str
    first_seq: int
    created: RolloutCreated | None = None
    rewards: dict[str, Reward] = field(default_factory=dict)
    turns: list[TurnRecord] = field(default_factory=list)
    sealed: RolloutSealed | None = None


@dataclass(slots=True)
class Recovered:
    """What the journal holds that the shards do not."""

    frames: int = 0
    undecodable: int = 0
    policy_version: int | None = None
    policy_seq: int = 0
    unpublished_turns: list[TurnRecord] = field(default_factory=list)
    unpublished_first_seq: int | None = None
    retired_rollouts: int = 0  # published in full, their first frames already removed
    open_rollouts: list[RecoveredRollout] = field(default_factory=list)
    sealed_rollouts: list[RecoveredRollout] = field(default_factory=list)
    published_samples: set[tuple[str, int]] = field(default_factory=set)
    published_rollouts: set[str] = field(default_factory=set)


def published_keys(output: Path) -> tuple[set[tuple[str, int]], set[tuple[str, int]], set[str]]:
    """What the shards under `output` hold: (turn_id, choice) keys of turns,
    (rollout_id, sample_index) keys of samples, and rollout ids."""
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


def recover(journal: Journal, output: Path) -> Recovered:
    """Replay `journal` against the shards under `output`."""
    result = Recovered()
    rollouts: dict[str, RecoveredRollout] = {}
    frames = list(journal.replay())
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
            state = rollouts[event.rollout_id] = RecoveredRollout(event.rollout_id, frame.seq)
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


def apply_recovery(recovered: Recovered, proxy: Proxy, *, restore_open: bool = True) -> None:
    """Hand what was missing to the recorder; restore the open rollouts, or seal them."""
    if not recovered.frames:
        return
    if recovered.policy_version is not None:
        proxy.policy_version, proxy.policy_seq = recovered.policy_version, recovered.policy_seq
    if recovered.unpublished_turns:
        proxy.recorder.submit_turns(
            recovered.unpublished_turns, pin=recovered.unpublished_first_seq
        )
    for state in recovered.open_rollouts:
        proxy.registry.restore(_rollout(state))
    if not restore_open:
        proxy.registry.seal_all(RolloutStatus.INTERRUPTED)
    for state in recovered.sealed_rollouts:
        rollout = _rollout(state)
        assert state.sealed is not None
        rollout.status, rollout.sealed_at = state.sealed.status, state.sealed.sealed_at
        skip_rollout = state.rollout_id in recovered.published_rollouts
        skip = frozenset(i for rid, i in recovered.published_samples if rid == state.rollout_id)
        proxy.hand_over(rollout, skip_samples=skip, skip_rollout=skip_rollout)
    log.info(
        "recovered %d journal frames: %d turns republished, %d open rollouts restored, "
        "%d sealed rollouts re-stitched, %d already published, %d undecodable frames",
        recovered.frames,
        len(recovered.unpublished_turns),
        len(recovered.open_rollouts),
        len(recovered.sealed_rollouts),
        recovered.retired_rollouts,
        recovered.undecodable,
    )


def _rollout(state: RecoveredRollout) -> Rollout:
    created = state.created
    rollout = Rollout(
        state.rollout_id,
        group_id=created.group_id if created else None,
        task_id=created.task_id if created else None,
        metadata=created.metadata if created else None,
        implicit=created.implicit if created else False,
    )
    rollout.first_seq = state.first_seq
    if created is not None:
        rollout.created_at = created.created_at
    rollout.rewards = dict(state.rewards)
    rollout.turns = sorted(state.turns, key=lambda t: (t.turn_index, t.choice_index))
    rollout.num_turns = len({t.turn_id for t in state.turns})
    rollout.next_turn_index = max((t.turn_index for t in state.turns), default=-1) + 1
    rollout.policy_versions = {t.policy_version for t in state.turns}
    return rollout
