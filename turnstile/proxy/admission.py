"""Admission control: new rollouts wait or get 429 while the harness is too far ahead.

In asynchronous RL the harness generates while the trainer trains; each trainer step
takes a batch of rollouts and pushes new weights (`POST /admin/policy_version`). If
generation outruns training, the rollouts started now are trained on many versions
later: staleness grows without bound, and is only filtered after the fact.

With `max_open_rollouts_per_version` = N (the rollouts the trainer takes per version)
and `max_staleness` = S, a new rollout is admitted while

    rollouts created since start-up < N * (versions since start-up + 1 + S)

so the harness is at most S versions of data ahead of the trainer (AReaL's bound on
off-policyness, with N its batch size). Otherwise `POST /rollouts` (or the first call of
a rollout that names a new id) gets 429 with Retry-After, or waits for the next version
(`admission = "wait"`, up to `ADMISSION_WAIT_TIMEOUT_S`). `ahead` is how many versions of
data the harness is ahead; `/stats` and `/metrics` show it. The counts start at
start-up: a restarted proxy admits a fresh window.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Final, Literal

from turnstile.errors import TooManyRequests

# A client told to wait retries after this long: a trainer step is seconds to minutes.
ADMISSION_RETRY_AFTER_S: Final[int] = 2
# With `admission = "wait"`, a creation waits this long for the trainer's next version,
# then gets 429 (well under the clients' own timeouts of 10 minutes).
ADMISSION_WAIT_TIMEOUT_S: Final[float] = 300.0

AdmissionMode = Literal["refuse", "wait"]


class Admission:
    """Counts rollout creations against the policy versions the trainer has pushed."""

    def __init__(
        self,
        per_version: int | None,
        max_staleness: int,
        start_version: int,
        mode: AdmissionMode = "refuse",
    ) -> None:
        self.per_version = per_version
        self.max_staleness = max_staleness
        self.mode = mode
        self._start_version = start_version
        self._version = start_version
        self.created = 0
        self.refused = 0
        self._changed = asyncio.Event()

    @property
    def enabled(self) -> bool:
        return self.per_version is not None

    @property
    def allowance(self) -> int | None:
        """Rollouts that may be created in all, at the current version (None: no limit)."""
        if self.per_version is None:
            return None
        versions = max(0, self._version - self._start_version)
        return self.per_version * (versions + 1 + self.max_staleness)

    @property
    def ahead(self) -> float | None:
        """Versions of data the harness is ahead of the trainer (None: no limit set)."""
        if self.per_version is None:
            return None
        return self.created / self.per_version - max(0, self._version - self._start_version)

    def restart_at(self, version: int) -> None:
        """Count from `version` (the one a restart rebuilt from the journal)."""
        self._start_version = self._version = version

    def version_changed(self, version: int) -> None:
        """The trainer pushed `version`: more rollouts may be admitted."""
        self._version = version
        self._changed.set()
        self._changed = asyncio.Event()

    def admit(self) -> None:
        """Count a new rollout, or raise `TooManyRequests` (429) if it is not admitted."""
        allowance = self.allowance
        if allowance is not None and self.created >= allowance:
            self.refused += 1
            raise TooManyRequests(
                f"the harness is {self.ahead:.1f} policy versions ahead of the trainer "
                f"({self.created} rollouts for {self._version - self._start_version + 1} "
                f"versions at {self.per_version} per version, max_staleness "
                f"{self.max_staleness}): retry once the trainer pushes the next version",
                retry_after_s=ADMISSION_RETRY_AFTER_S,
            )
        self.created += 1

    async def wait_for_room(self) -> None:
        """In "wait" mode, wait (bounded) until a new rollout would be admitted."""
        if self.mode != "wait" or self.allowance is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ADMISSION_WAIT_TIMEOUT_S
        while (allowance := self.allowance) is not None and self.created >= allowance:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return  # `admit` answers 429
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
