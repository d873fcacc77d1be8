"""An incremental Server-Sent Events parser for relaying backend streams.

Bytes arrive from the backend in arbitrary pieces; `SSEParser.feed` returns each
complete event as soon as its blank-line terminator has arrived, so events are relayed
one by one as the backend produces them. Only `data:` fields matter to Chat
Completions streams; other fields are kept in the raw bytes and ignored otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

# An event larger than this is not a token chunk; refuse rather than buffer forever.
MAX_EVENT_BYTES = 16 * 1024 * 1024

DONE = b"[DONE]"


class SSEError(Exception):
    """The stream is not well-formed Server-Sent Events."""


@dataclass(frozen=True, slots=True)
class SSEEvent:
    raw: bytes  # the event as received, including its terminating blank line
    data: bytes | None  # the joined data lines, or None for an event without data


class SSEParser:
    """Splits a byte stream into events at blank lines (LF, CRLF or CR line ends)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        buf = self._buf + chunk if self._buf else chunk
        held = b""
        if b"\r" in buf:
            if buf.endswith(b"\r"):
                # A CR at the end may be the first half of a CRLF split across chunks.
                buf, held = buf[:-1], b"\r"
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        events: list[SSEEvent] = []
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            block = buf[start:end]
            start = end + 2
            if block.strip(b"\n"):
                events.append(SSEEvent(raw=block.lstrip(b"\n") + b"\n\n", data=_data(block)))
        self._buf = buf[start:] + held
        if len(self._buf) > MAX_EVENT_BYTES:
            raise SSEError(f"an SSE event exceeded {MAX_EVENT_BYTES} bytes")
        return events

    def finish(self) -> list[SSEEvent]:
        """At the end of the stream: a held final CR is a line end after all."""
        if not self._buf.endswith(b"\r"):
            return []
        buf, self._buf = self._buf[:-1] + b"\n", b""
        return self.feed(buf)

    def pending(self) -> bytes:
        """Bytes received after the last complete event (a torn last event)."""
        return self._buf


def _data(block: bytes) -> bytes | None:
    parts: list[bytes] = []
    for line in block.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
    if not parts:
        return None
    return b"\n".join(parts)


def encode_data(payload: bytes) -> bytes:
    """One SSE event carrying `payload` as its data."""
    return b"data: " + payload + b"\n\n"
