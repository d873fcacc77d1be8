"""The conversation behind each Responses answer, for `previous_response_id`.

A Responses call may name an earlier answer instead of re-sending the conversation. Each
answer's entry holds the id of the answer it continued and the chat messages it added (its
new input and its own output), so a chain is rebuilt by walking back the links and a
conversation is stored once, not once per turn. Entries are appended as JSON lines to
`conversations.jsonl` (under the output directory's `responses/`) before the answer
is sent, flushed (and fsynced with `fsync: always`), and read back at start-up: a restart
does not break a chain. The newest entries are kept, at most `MAX_STORED_RESPONSES` of them
and `MAX_STORED_RESPONSE_BYTES` of JSON (inline images make an entry large); the file is
rewritten from them once it passes `COMPACT_BYTES`. A line torn by a crash is skipped.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

import orjson

from turnstile.errors import BadRequest, TurnstileError
from turnstile.limits import OUTPUT_FILE_MODE

log = logging.getLogger("turnstile.protocols.conversations")

FILE_NAME: Final[str] = "conversations.jsonl"
# Answers whose conversations are kept: an agent fleet's live chains (a few hundred
# rollouts of a hundred calls) fit many times over; an older link ends its chain (400).
MAX_STORED_RESPONSES: Final[int] = 200_000
# The kept entries' JSON, in all: a Responses input with an inline screenshot is about a
# megabyte of base64, so the entry count alone does not bound memory. Half of
# COMPACT_BYTES, so that a compacted file is at most half full and compactions stay rare.
MAX_STORED_RESPONSE_BYTES: Final[int] = 256 * 1024 * 1024
# A chain longer than this is refused rather than walked (a cycle cannot be written, but
# a file edited by hand could hold one).
MAX_CHAIN_LENGTH: Final[int] = 100_000
# The file is rewritten from the kept entries once it grows past this.
COMPACT_BYTES: Final[int] = 512 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class _Entry:
    previous: str | None
    added: list[dict[str, Any]]
    size: int  # bytes of its JSON line


class ConversationStore:
    """Each answer's added messages and its predecessor; on disk when given a directory."""

    def __init__(
        self,
        directory: Path | None,
        *,
        fsync: bool = False,
        max_entries: int = MAX_STORED_RESPONSES,
        max_bytes: int = MAX_STORED_RESPONSE_BYTES,
    ) -> None:
        self.path = None if directory is None else directory / FILE_NAME
        self.fsync = fsync
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self._file: IO[bytes] | None = None

    def open(self) -> None:
        """Read what an earlier run stored and open the file for appending."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            with self.path.open("rb") as f:
                for line in f:
                    self._load_line(line)
            log.info("read %d stored Responses conversations", len(self._entries))
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, OUTPUT_FILE_MODE)
        self._file = os.fdopen(fd, "ab")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _load_line(self, line: bytes) -> None:
        try:
            obj = orjson.loads(line)
            rid, previous, added = obj["id"], obj["previous"], obj["added"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return  # a torn last line
        if isinstance(rid, str) and isinstance(added, list):
            previous = previous if isinstance(previous, str) else None
            self._keep(rid, _Entry(previous, added, len(line)))

    def _keep(self, response_id: str, entry: _Entry) -> None:
        replaced = self._entries.pop(response_id, None)
        if replaced is not None:
            self._bytes -= replaced.size
        self._entries[response_id] = entry
        self._bytes += entry.size
        while len(self._entries) > 1 and (
            len(self._entries) > self.max_entries or self._bytes > self.max_bytes
        ):
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= dropped.size

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The chat messages of the conversation up to and including `response_id`'s
        answer (400 when it, or an earlier link, is not known)."""
        parts: list[list[dict[str, Any]]] = []
        current: str | None = response_id
        while current is not None:
            entry = self._entries.get(current)
            if entry is None or len(parts) >= MAX_CHAIN_LENGTH:
                which = "" if current == response_id else f" (its earlier response {current})"
                raise BadRequest(
                    f"previous response {response_id!r:.80} was not found{which}",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            parts.append(entry.added)
            current = entry.previous
        return [message for part in reversed(parts) for message in part]

    def store(self, response_id: str, previous: str | None, added: list[dict[str, Any]]) -> None:
        """Remember an answer's conversation step, on disk before this returns."""
        line = orjson.dumps({"id": response_id, "previous": previous, "added": added})
        entry = _Entry(previous, added, len(line) + 1)
        if self._file is not None:
            try:
                self._file.write(line + b"\n")
                self._file.flush()
                if self.fsync:
                    os.fsync(self._file.fileno())
            except OSError as exc:
                raise TurnstileError(
                    f"could not store the response's conversation: {exc}"
                ) from None
        self._keep(response_id, entry)
        if self._file is not None and self._file.tell() > COMPACT_BYTES:
            self._compact()

    def _compact(self) -> None:
        assert self.path is not None and self._file is not None
        staged = self.path.with_suffix(".tmp")
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, OUTPUT_FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            for rid, entry in self._entries.items():
                record = {"id": rid, "previous": entry.previous, "added": entry.added}
                f.write(orjson.dumps(record) + b"\n")
            f.flush()
            os.fsync(f.fileno())
        self._file.close()
        os.replace(staged, self.path)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND, OUTPUT_FILE_MODE)
        self._file = os.fdopen(fd, "ab")
