"""Rollout state: creation, turn bookkeeping, rewards, sealing and the idle sweep.

All methods run on the event loop (no locks). A rollout is sealed by `finish`, by the
idle timeout (`abandoned`) or at shutdown (`interrupted`); once sealed it refuses new
turns and rewards with 409. The rollout's turns are handed to `on_seal` only when the
last in-flight turn has ended, so a sample never misses a turn that was under way.

Rollouts may belong to a group (a GRPO group: one prompt, several rollouts) whose size
is declared when they are created; the group is complete once that many rollouts are
sealed and handed over, which is when the writer is asked to publish it.
"""

from __future__ import annotations

import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from turnstile.errors import BadRequest, Conflict, NotFound, Overloaded, Unprocessable
from turnstile.journal.codec import Event, RewardsPosted, RolloutCreated, RolloutSealed
from turnstile.limits import (
    MAX_GROUP_SIZE,
    MAX_OPEN_ROLLOUT_BYTES,
    MAX_ROLLOUT_BYTES,
    MAX_ROLLOUT_ID_LENGTH,
)
from turnstile.records import Reward, RolloutStatus, TurnRecord

# Sealed rollouts kept for GET /rollouts/{id} (their turns are released at sealing):
# enough for the last few minutes of a busy fleet, and a bounded ~10-20 MB of memory.
MAX_SEALED_REMEMBERED = 10_000
# Groups kept for GET /groups/{id}; complete groups beyond this are forgotten, oldest
# first (a group holds only its members' ids and statuses).
MAX_GROUPS_REMEMBERED = 10_000

# Matched whole (fullmatch): `$` would also match before a trailing newline.
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")


def turn_bytes(record: TurnRecord) -> int:
    """About how much memory a recorded turn holds (arrays, text and image bytes)."""
    size = (
        record.prompt_token_ids.nbytes
        + record.completion_token_ids.nbytes
        + record.behavior_logprobs.nbytes
        + sum(len(blob.data) for blob in record.media)
    )
    for text in (
        record.request_messages_json,
        record.request_tools_json,
        record.request_prompt_json,
        record.response_message_json,
        record.response_text,
    ):
        if text is not None:
            size += len(text)
    if record.top_logprob_ids is not None:
        size += 64 * sum(len(row) for row in record.top_logprob_ids)  # boxed ints, floats
    return size


def _random_id() -> str:
    return uuid.uuid4().hex


def check_rollout_id(rollout_id: str) -> str:
    if len(rollout_id) > MAX_ROLLOUT_ID_LENGTH or not _ID_RE.fullmatch(rollout_id):
        raise BadRequest(
            f"invalid rollout id {rollout_id[:MAX_ROLLOUT_ID_LENGTH]!r}: use up to "
            f"{MAX_ROLLOUT_ID_LENGTH} characters of letters, digits and . _ : -",
            param="rollout_id",
        )
    return rollout_id


@dataclass(slots=True)
class Rollout:
    rollout_id: str
    group_id: str | None = None
    task_id: str | None = None
    metadata: dict[str, Any] | None = None
    implicit: bool = False  # created for a request that named no rollout
    status: RolloutStatus = RolloutStatus.OPEN
    rewards: dict[str, Reward] = field(default_factory=dict)
    turns: list[TurnRecord] = field(default_factory=list)
    next_turn_index: int = 0
    in_flight: int = 0
    created_at: float = field(default_factory=time.time)
    last_activity: float = field(default_factory=time.monotonic)
    sealed_at: float | None = None
    handed_over: bool = False
    num_turns: int = 0
    policy_versions: set[int] = field(default_factory=set)
    first_seq: int | None = None  # the journal frame that created it (kept until published)
    held_bytes: int = 0  # memory its turns hold until it is handed over
    group_size: int | None = None  # as declared at creation (the group's may come later)

    @property
    def sealed(self) -> bool:
        return self.status is not RolloutStatus.OPEN

    def summary(self) -> dict[str, Any]:
        return {
            "rollout_id": self.rollout_id,
            "group_id": self.group_id,
            "group_size": self.group_size,
            "task_id": self.task_id,
            "metadata": self.metadata,
            "status": self.status.value,
            "num_turns": self.num_turns,
            "in_flight": self.in_flight,
            "rewards": {
                name: {"value": r.value, "info": r.info} for name, r in self.rewards.items()
            },
            "policy_versions": sorted(self.policy_versions),
            "created_at": self.created_at,
            "sealed_at": self.sealed_at,
            "recorded": self.handed_over,
        }


@dataclass(slots=True)
class Group:
    """The rollouts of one group, and how many of them are sealed and handed over."""

    group_id: str
    size: int | None = None
    members: dict[str, RolloutStatus] = field(default_factory=dict)
    handed_over: int = 0

    @property
    def complete(self) -> bool:
        """All declared rollouts are sealed and handed to the writer."""
        return self.size is not None and self.handed_over >= self.size

    def summary(self) -> dict[str, Any]:
        sealed = sum(status is not RolloutStatus.OPEN for status in self.members.values())
        return {
            "group_id": self.group_id,
            "group_size": self.size,
            "num_rollouts": len(self.members),
            "sealed": sealed,
            "recorded": self.handed_over,
            "complete": self.complete,
            "rollouts": {rid: status.value for rid, status in self.members.items()},
        }


class RolloutRegistry:
    """The open rollouts, and a bounded memory of sealed ones and of groups."""

    def __init__(
        self,
        on_seal: Callable[[Rollout], None],
        idle_timeout_s: float,
        on_event: Callable[[Event], int] | None = None,
        *,
        new_id: Callable[[], str] | None = None,
        max_rollout_bytes: int = MAX_ROLLOUT_BYTES,
        max_open_bytes: int = MAX_OPEN_ROLLOUT_BYTES,
        admit: Callable[[], None] | None = None,
    ) -> None:
        self._on_seal = on_seal
        self._admit = admit  # admission control: raises to refuse a new rollout
        self.on_event = on_event  # journals creations, rewards and seals
        self._idle_timeout_s = idle_timeout_s
        self.max_rollout_bytes = max_rollout_bytes
        self.max_open_bytes = max_open_bytes
        self.held_bytes = 0  # all open rollouts' turns
        # Ids for rollouts the client did not name; with several workers, ids this
        # worker owns (turnstile.server.workers), so their later calls come back here.
        self._new_id: Callable[[], str] = new_id or _random_id
        self._open: dict[str, Rollout] = {}
        self._sealed: OrderedDict[str, Rollout] = OrderedDict()
        self._groups: OrderedDict[str, Group] = OrderedDict()

    # -- lookup ------------------------------------------------------------------------
    def get(self, rollout_id: str) -> Rollout:
        found = self._open.get(rollout_id) or self._sealed.get(rollout_id)
        if found is None:
            raise NotFound(f"rollout {rollout_id!r} does not exist", param="rollout_id")
        return found

    @property
    def open_count(self) -> int:
        return len(self._open)

    def known(self, rollout_id: str) -> bool:
        """Whether `rollout_id` is open or remembered as sealed."""
        return rollout_id in self._open or rollout_id in self._sealed

    def group(self, group_id: str) -> Group:
        found = self._groups.get(group_id)
        if found is None:
            raise NotFound(f"group {group_id!r} is not known here", param="group_id")
        return found

    def group_of(self, rollout: Rollout) -> Group | None:
        """The group of `rollout`, while it is remembered."""
        return None if rollout.group_id is None else self._groups.get(rollout.group_id)

    def _join_group(self, rollout: Rollout) -> None:
        """Add `rollout` to its group (checked by `_check_group` first)."""
        if rollout.group_id is None:
            return
        group = self._groups.get(rollout.group_id)
        if group is None:
            group = self._groups[rollout.group_id] = Group(rollout.group_id)
        if rollout.group_size is not None:
            group.size = rollout.group_size
        group.members[rollout.rollout_id] = rollout.status
        while len(self._groups) > MAX_GROUPS_REMEMBERED:
            oldest = next(iter(self._groups.values()))
            if not oldest.complete:
                break
            self._groups.popitem(last=False)

    def _check_group(self, group_id: str | None, group_size: int | None) -> None:
        if group_size is None:
            return
        if group_id is None:
            raise Unprocessable("group_size needs a group_id", param="group_size")
        if not 1 <= group_size <= MAX_GROUP_SIZE:
            raise Unprocessable(
                f"group_size must be 1 to {MAX_GROUP_SIZE}, not {group_size}", param="group_size"
            )
        group = self._groups.get(group_id)
        if group is None:
            return
        if group.size is not None and group.size != group_size:
            raise Conflict(
                f"group {group_id!r} was declared with {group.size} rollouts, not {group_size}",
                param="group_size",
            )
        if len(group.members) >= group_size:
            raise Conflict(
                f"group {group_id!r} already has {len(group.members)} rollouts",
                param="group_size",
            )

    def oldest_seq(self) -> int | None:
        """The oldest journal frame an open (not yet handed over) rollout needs."""
        seqs = [r.first_seq for r in self._open.values() if r.first_seq is not None]
        return min(seqs) if seqs else None

    def older_than(self, seq: int) -> list[Rollout]:
        """Open rollouts that need journal frames before `seq`."""
        return [r for r in self._open.values() if r.first_seq is not None and r.first_seq < seq]

    def checkpoint(self, rollout: Rollout) -> None:
        """Journal the rollout's whole state again, so its older frames can be removed.

        Applying a checkpoint again is idempotent: the rebuild keeps one copy of each turn and the
        latest creation, rewards and seal, so old and new frames may coexist.
        """
        if self.on_event is None:
            return
        rid = rollout.rollout_id
        seq = self.on_event(
            RolloutCreated(
                rid,
                rollout.group_id,
                rollout.task_id,
                rollout.metadata,
                rollout.implicit,
                rollout.created_at,
                rollout.group_size,
            )
        )
        if rollout.rewards:
            self.on_event(
                RewardsPosted(
                    rid,
                    {r.name: r.value for r in rollout.rewards.values()},
                    {r.name: r.info for r in rollout.rewards.values()},
                )
            )
        for turn in rollout.turns:
            self.on_event(turn)
        if rollout.sealed:
            self.on_event(RolloutSealed(rid, rollout.status, rollout.sealed_at or time.time()))
        rollout.first_seq = seq or None

    def create(
        self,
        rollout_id: str | None = None,
        *,
        group_id: str | None = None,
        task_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        implicit: bool = False,
        group_size: int | None = None,
    ) -> Rollout:
        rid = check_rollout_id(rollout_id) if rollout_id else self._new_id()
        if rid in self._open or rid in self._sealed:
            raise Conflict(f"rollout {rid!r} already exists", param="rollout_id")
        self._check_group(group_id, group_size)
        if self._admit is not None:
            self._admit()
        if group_id is not None and group_size is None and group_id in self._groups:
            group_size = self._groups[group_id].size  # declared by an earlier member
            if group_size is not None and len(self._groups[group_id].members) >= group_size:
                raise Conflict(
                    f"group {group_id!r} already has its {group_size} rollouts",
                    param="group_id",
                )
        rollout = Rollout(rid, group_id, task_id, metadata, implicit, group_size=group_size)
        if self.on_event is not None:  # journaled first: a failed append creates nothing
            seq = self.on_event(
                RolloutCreated(
                    rid, group_id, task_id, metadata, implicit, rollout.created_at, group_size
                )
            )
            rollout.first_seq = seq or None
        self._open[rid] = rollout
        self._join_group(rollout)
        return rollout

    def restore(self, rollout: Rollout) -> None:
        """Put back an open rollout rebuilt from the journal."""
        rollout.held_bytes = sum(map(turn_bytes, rollout.turns))
        self.held_bytes += rollout.held_bytes
        self._open[rollout.rollout_id] = rollout
        self._join_group(rollout)

    # -- turns -------------------------------------------------------------------------
    def begin_turn(self, rollout_id: str | None) -> tuple[Rollout, int]:
        """Reserve the next turn index of a rollout (created on first use)."""
        found = None
        if rollout_id is not None:
            found = self._open.get(rollout_id) or self._sealed.get(rollout_id)
        if found is not None:
            rollout = found
        else:
            rollout = self.create(rollout_id, implicit=rollout_id is None)
        if rollout.sealed:
            raise Conflict(
                f"rollout {rollout.rollout_id!r} is {rollout.status.value}; it takes no more turns",
                param="rollout_id",
            )
        if rollout.held_bytes > self.max_rollout_bytes:
            raise Conflict(
                f"rollout {rollout.rollout_id!r} holds {rollout.held_bytes >> 20} MiB of "
                f"turns, over the limit of {self.max_rollout_bytes >> 20} MiB: finish it "
                "and go on in a new rollout",
                param="rollout_id",
            )
        if self.held_bytes > self.max_open_bytes:
            raise Overloaded(
                f"open rollouts hold {self.held_bytes >> 20} MiB of turns, over the limit "
                f"of {self.max_open_bytes >> 20} MiB: finish rollouts, then retry",
                retry_after_s=5,
            )
        index = rollout.next_turn_index
        rollout.next_turn_index += 1
        rollout.in_flight += 1
        rollout.last_activity = time.monotonic()
        return rollout, index

    def end_turn(self, rollout: Rollout, records: list[TurnRecord]) -> None:
        """Attach a finished call's records; seal implicit rollouts after their turn."""
        rollout.in_flight -= 1
        rollout.last_activity = time.monotonic()
        if records:
            rollout.num_turns += 1
            rollout.turns.extend(records)
            held = sum(map(turn_bytes, records))
            rollout.held_bytes += held
            self.held_bytes += held
            rollout.policy_versions.update(r.policy_version for r in records)
        if rollout.implicit and not rollout.sealed:
            self._seal(rollout, RolloutStatus.FINISHED)
        else:
            self._maybe_hand_over(rollout)

    # -- rewards and sealing --------------------------------------------------------
    def add_rewards(
        self, rollout_id: str, rewards: dict[str, float], info: dict[str, str | None]
    ) -> Rollout:
        rollout = self.get(rollout_id)
        if rollout.sealed:
            raise Conflict(
                f"rollout {rollout_id!r} is {rollout.status.value}: post rewards before "
                "/finish, or send them in the /finish body",
                param="rollout_id",
            )
        if self.on_event is not None:
            self.on_event(RewardsPosted(rollout_id, dict(rewards), dict(info)))
        for name, value in rewards.items():
            rollout.rewards[name] = Reward(name, float(value), info.get(name))
        for name, text in info.items():
            if name not in rewards and name in rollout.rewards:
                old = rollout.rewards[name]
                rollout.rewards[name] = Reward(name, old.value, text)
        rollout.last_activity = time.monotonic()
        return rollout

    def finish(self, rollout_id: str) -> Rollout:
        rollout = self.get(rollout_id)
        if rollout.sealed:
            raise Conflict(
                f"rollout {rollout_id!r} is already {rollout.status.value}", param="rollout_id"
            )
        self._seal(rollout, RolloutStatus.FINISHED)
        return rollout

    def sweep(self, now: float | None = None) -> list[Rollout]:
        """Seal every open rollout idle past the timeout as abandoned."""
        now = time.monotonic() if now is None else now
        idle = [
            r
            for r in self._open.values()
            if r.in_flight == 0 and not r.sealed and now - r.last_activity > self._idle_timeout_s
        ]
        for rollout in idle:
            self._seal(rollout, RolloutStatus.ABANDONED)
        return idle

    def seal_all(self, status: RolloutStatus = RolloutStatus.INTERRUPTED) -> int:
        """Seal every open rollout (at shutdown); returns how many were sealed."""
        pending = [r for r in self._open.values() if not r.sealed]
        for rollout in pending:
            self._seal(rollout, status)
        for rollout in list(self._open.values()):
            rollout.in_flight = 0
            self._maybe_hand_over(rollout)
        return len(pending)

    def _seal(self, rollout: Rollout, status: RolloutStatus) -> None:
        rollout.status = status
        rollout.sealed_at = time.time()
        group = self.group_of(rollout)
        if group is not None:
            group.members[rollout.rollout_id] = status
        if self.on_event is not None:
            self.on_event(RolloutSealed(rollout.rollout_id, status, rollout.sealed_at))
        self._maybe_hand_over(rollout)

    def _maybe_hand_over(self, rollout: Rollout) -> None:
        if not rollout.sealed or rollout.in_flight > 0 or rollout.handed_over:
            return
        rollout.handed_over = True
        group = self.group_of(rollout)
        if group is not None:
            group.handed_over += 1
        self._open.pop(rollout.rollout_id, None)
        self.held_bytes -= rollout.held_bytes
        rollout.held_bytes = 0
        self._on_seal(rollout)
        rollout.turns = []
        self._sealed[rollout.rollout_id] = rollout
        while len(self._sealed) > MAX_SEALED_REMEMBERED:
            self._sealed.popitem(last=False)
