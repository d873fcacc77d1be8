"""Journal retention: removes journal segments whose every frame is in published shards.

A frame is still needed while the writer holds work pinned to it that is not yet in a
published shard (`Recorder.oldest_pin`), or while an open rollout began at or before it
(start-up rebuilds the rollout from its frames). Each pass finds the oldest segments the
writer no longer needs; open rollouts that still reach back into them are checkpointed
(their whole state journaled again, `RolloutRegistry.checkpoint`), so a long-lived
rollout never holds the journal back; so is the frame holding the current policy
version. Once the new frames are durable, every segment before `Proxy.retention_floor`
is deleted, oldest first, never the one being appended to.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from turnstile.journal.wal import JournalError, SegmentInfo

if TYPE_CHECKING:
    from turnstile.proxy.core import Proxy

log = logging.getLogger("turnstile.retention")


def removable_through(segments: Sequence[SegmentInfo], floor: int) -> SegmentInfo | None:
    """The newest of the oldest-first `segments` whose frames all precede `floor`."""
    last = None
    for segment in segments:
        if segment.active or segment.end_seq is None or segment.end_seq > floor:
            break
        last = segment
    return last


async def retain_once(proxy: Proxy) -> int:
    """Delete the segments nothing needs any more; returns how many were deleted."""
    journal = proxy.journal
    if not journal.attached:
        return 0
    segments = await asyncio.to_thread(journal.segments)
    pins = [journal.next_seq, proxy.recorder.oldest_pin]
    candidate = removable_through(segments, min(p for p in pins if p is not None))
    if candidate is None:
        return 0
    assert candidate.end_seq is not None
    for rollout in proxy.registry.older_than(candidate.end_seq):
        proxy.registry.checkpoint(rollout)
    if 0 < proxy.policy_seq < candidate.end_seq:
        await proxy.set_policy_version(proxy.policy_version)
    await journal.durable()
    through = removable_through(segments, proxy.retention_floor())
    if through is None:
        return 0
    return await asyncio.to_thread(journal.remove_through, through.segment_id)


async def retain_forever(proxy: Proxy, interval_s: float) -> None:
    """Run `retain_once` every `interval_s` seconds until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            removed = await retain_once(proxy)
        except (JournalError, OSError) as exc:
            log.warning("journal retention skipped: %s", exc)
            continue
        if removed:
            log.debug("removed %d published journal segments", removed)
