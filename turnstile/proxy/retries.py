"""Idempotent retries: an SDK retry of a call that succeeded gets the remembered answer.

The openai SDKs send `x-stainless-retry-count` (0 on the first try) and many clients an
`Idempotency-Key`. A call carrying either is remembered under a digest of its rollout,
endpoint, body and key. A retry (count > 0, or a key seen before) of a call that
finished `ok` gets the same bytes again and records nothing, so the turn is recorded
once; a retry of a call still in flight waits for it. Calls without these headers are
never deduplicated: identical prompts are legitimate separate samples (GRPO groups).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

# Answers kept for retries. SDK retries come within seconds to minutes of the first try.
MAX_ENTRIES = 4096
# Total bytes of kept answers; a larger answer is simply not kept.
MAX_BYTES = 256 * 1024 * 1024
MAX_ENTRY_BYTES = 16 * 1024 * 1024
# How long a retry waits for the first try still in flight before giving up with 409.
WAIT_FOR_ORIGINAL_S = 600.0


@dataclass(slots=True)
class Answer:
    status: int
    content_type: str
    chunks: list[bytes]
    headers: dict[str, str] = field(default_factory=dict)
    stream: bool = False

    @property
    def size(self) -> int:
        return sum(len(c) for c in self.chunks)


@dataclass(slots=True)
class _Entry:
    done: asyncio.Event = field(default_factory=asyncio.Event)
    answer: Answer | None = None


def answer_key(
    rollout_id: str | None,
    endpoint: str,
    body: bytes,
    idempotency_key: str | None,
    retry_count: str | None,
) -> str | None:
    """The digest a call's answer is remembered under, or None when it is not kept."""
    if idempotency_key is None and retry_count is None:
        return None
    h = hashlib.sha256()
    for part in (rollout_id or "", endpoint, idempotency_key or ""):
        h.update(part.encode())
        h.update(b"\0")
    h.update(body)
    return h.hexdigest()


def is_retry(retry_count: str | None, idempotency_key: str | None) -> bool:
    if idempotency_key is not None:
        return True
    try:
        return retry_count is not None and int(retry_count) > 0
    except ValueError:
        return False


class AnswerCache:
    """A bounded memory of answers to re-send to retries, oldest evicted first."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._bytes = 0
        self.resent = 0

    def begin(self, key: str) -> None:
        """Mark a first try as in flight."""
        self._entries[key] = _Entry()
        self._entries.move_to_end(key)
        self._evict()

    async def lookup(self, key: str) -> Answer | None:
        """The answer to re-send to a retry, waiting for a first try in flight."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if not entry.done.is_set():
            try:
                await asyncio.wait_for(entry.done.wait(), WAIT_FOR_ORIGINAL_S)
            except TimeoutError:
                return None
        if entry.answer is not None:
            self.resent += 1
        return entry.answer

    def complete(self, key: str, answer: Answer | None) -> None:
        """The first try ended: `answer` is kept when it succeeded and is small enough."""
        entry = self._entries.get(key)
        if entry is None:
            return
        if answer is not None and answer.size <= MAX_ENTRY_BYTES:
            entry.answer = answer
            self._bytes += answer.size
        else:
            self._entries.pop(key, None)
        entry.done.set()
        self._evict()

    def _evict(self) -> None:
        while self._entries and (
            len(self._entries) > self._max_entries or self._bytes > self._max_bytes
        ):
            _, old = self._entries.popitem(last=False)
            if old.answer is not None:
                self._bytes -= old.answer.size
            old.done.set()
