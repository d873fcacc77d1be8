"""The proxy's journal: its events appended as frames, their durability, retired segments.

`TurnJournal` is what the proxy and the rollout registry write through. It is built
detached (before start-up has opened the journal directory): then it journals nothing,
appends answer sequence number 0 and everything is durable at once. Start-up rebuilds
the previous run's state from the opened `Journal` and then `attach`es it, so what the
rebuild itself seals is not journaled again. Retention removes published segments
through it, which keeps the count of removed segments in one place.
"""

from __future__ import annotations

from turnstile.journal.codec import Event, encode_event
from turnstile.journal.wal import Journal, SegmentInfo


class TurnJournal:
    """Events to journal frames, over a `Journal` once one is attached."""

    def __init__(self) -> None:
        self._journal: Journal | None = None
        self._segments_removed = 0

    def attach(self, journal: Journal) -> None:
        """Journal every later event to `journal` (opened and rebuilt from at start-up)."""
        self._journal = journal

    @property
    def attached(self) -> bool:
        return self._journal is not None

    # -- appending ------------------------------------------------------------------
    def append(self, event: Event) -> int:
        """Append `event`; its sequence number (0 when detached). JournalError if refused."""
        if self._journal is None:
            return 0
        kind, payload = encode_event(event)
        return self._journal.append(kind, payload)

    async def durable(self, seq: int | None = None) -> None:
        """Wait until frame `seq` (default: the latest) is durable; JournalError if not."""
        if self._journal is None:
            return
        await self._journal.wait_durable(self._journal.last_seq if seq is None else seq)

    @property
    def next_seq(self) -> int:
        """The sequence number the next append gets (1 when detached)."""
        return 1 if self._journal is None else self._journal.last_seq + 1

    @property
    def healthy(self) -> bool:
        """False once the attached journal fails or closes; True while detached."""
        return self._journal is None or self._journal.healthy

    # -- segments -------------------------------------------------------------------
    def segments(self) -> list[SegmentInfo]:
        """The journal's segments, oldest first (none while detached)."""
        return [] if self._journal is None else self._journal.segments()

    def remove_through(self, segment_id: int) -> int:
        """Delete the published segments up to `segment_id`; how many were deleted."""
        if self._journal is None:
            return 0
        removed = self._journal.remove_through(segment_id)
        self._segments_removed += removed
        return removed

    @property
    def segments_removed(self) -> int:
        """Segments removed once published, in this run."""
        return self._segments_removed
