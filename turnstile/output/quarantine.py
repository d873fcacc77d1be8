"""The quarantine: rows that cannot be written to their table, kept with the reason.

One bad value must never cost anyone else's data. When a chunk of rows cannot be built
into an Arrow table, the sink finds the rows that fail (`isolate`), publishes their
neighbours, and writes each failing row to the `quarantine` table instead: the table it
was meant for, its keys, the reason and the record itself. A turn is kept as its
journal frame payload (`turnstile.journal.codec.decode_turn` reads it back); a sample, a
rollout, or a turn the codec cannot encode either, as JSON.

A quarantined row counts as settled: the journal frames behind it may be removed, the
start-up rebuild does not write it again, and `turnstile verify` counts journaled turns
against the shards plus the quarantine. `quarantine` never raises: every field it
returns is safe to write (valid UTF-8, keys within int64), so the quarantine row itself
cannot fail the way the row it replaces did.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import json
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import numpy as np
import pyarrow as pa

from turnstile.journal.codec import encode_turn
from turnstile.records import QuarantineRecord, RolloutRecord, SampleRecord, TurnRecord

# A reason longer than this is cut (an exception text can quote a whole value).
MAX_REASON_CHARS: Final[int] = 4096
_INT64: Final[range] = range(-(2**63), 2**63)

# The exceptions that mean "these records cannot be converted to Arrow": a bad value,
# not a failing disk (building a table in memory does no I/O).
CONVERSION_ERRORS: Final[tuple[type[Exception], ...]] = (
    ValueError,
    TypeError,
    AttributeError,
    OverflowError,
    IndexError,
    KeyError,
    NotImplementedError,
    pa.ArrowException,
)

T = TypeVar("T")
R = TypeVar("R")


def safe_text(value: object) -> str:
    """`value` as text that encodes to UTF-8 (lone surrogates escaped)."""
    text = value if isinstance(value, str) else repr(value)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _optional_text(value: object) -> str | None:
    return None if value is None else safe_text(value)


def _optional_int64(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        return None
    number = int(value)
    return number if number in _INT64 else None


def _jsonable(value: Any) -> Any:
    """A JSON-safe copy of a record's value: arrays as lists, non-finite floats as text."""
    if isinstance(value, enum.Enum):
        return _jsonable(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, np.ndarray):
        return [_jsonable(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return _jsonable(value.item())
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, bytes | bytearray | memoryview):  # image bytes: kept exactly
        return {"base64": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {safe_text(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, bool | int):
        return value
    return safe_text(value)


def _encode(record: object) -> tuple[str, bytes]:
    """The record's bytes: a turn's journal payload where the codec takes it, else JSON."""
    if isinstance(record, TurnRecord):
        try:
            return "journal", encode_turn(record)
        except Exception:  # any failure falls back to JSON
            pass
    try:
        return "json", json.dumps(_jsonable(record), ensure_ascii=True).encode()
    except Exception:  # the last resort cannot fail
        return "json", json.dumps({"repr": safe_text(repr(record))}).encode()


def quarantine(
    table: str, record: object, reason: str, *, now: float | None = None
) -> QuarantineRecord:
    """The quarantine row for `record` (meant for `table`), which failed for `reason`."""
    record_format, data = _encode(record)
    turn_id = choice_index = sample_index = None
    if isinstance(record, TurnRecord):
        turn_id, choice_index = record.turn_id, record.choice_index
    elif isinstance(record, SampleRecord):
        sample_index = record.sample_index
    rollout_id = getattr(record, "rollout_id", None)
    if not isinstance(record, TurnRecord | SampleRecord | RolloutRecord) and isinstance(
        record, dict
    ):
        rollout_id = record.get("rollout_id")
    text = safe_text(reason)
    if len(text) > MAX_REASON_CHARS:
        text = text[:MAX_REASON_CHARS] + "..."
    return QuarantineRecord(
        table=safe_text(table),
        reason=text,
        record_format=record_format,
        record=data,
        quarantined_at=time.time() if now is None else now,
        rollout_id=_optional_text(rollout_id),
        turn_id=_optional_text(turn_id),
        choice_index=_optional_int64(choice_index),
        sample_index=_optional_int64(sample_index),
    )


def isolate(
    rows: Sequence[T], build: Callable[[Sequence[T]], R]
) -> tuple[list[tuple[Sequence[T], R]], list[tuple[T, str]]]:
    """Split `rows` into parts that `build` takes (each with what it built, in order) and
    the rows it refuses, each with the reason.

    Halves the rows until each refused one stands alone: a few bad rows among n cost
    O(bad * log n) builds. `build` raising one of `CONVERSION_ERRORS` means refused.
    """
    good: list[tuple[Sequence[T], R]] = []
    bad: list[tuple[T, str]] = []
    pending: list[Sequence[T]] = [rows]
    while pending:
        part = pending.pop()
        try:
            built = build(part)
        except CONVERSION_ERRORS as exc:
            if len(part) == 1:
                bad.append((part[0], f"{type(exc).__name__}: {exc}"))
            else:
                middle = len(part) // 2
                pending += [part[middle:], part[:middle]]  # the first half is tried first
            continue
        good.append((part, built))
    return good, bad
