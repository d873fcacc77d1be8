"""Byte codecs for the events Turnstile writes to its journal.

Each event is one journal frame whose `kind` is an `EventKind`. A payload is

    u8 codec version | u32 header length | header (orjson) | raw blocks

The header holds strings, ints, bools and enums; every float and every array goes into a
raw little-endian block (listed by byte length in the header under `"_b"`), so values
that JSON cannot carry exactly (NaN payloads, infinities, -0.0, float32 bit patterns)
come back bit for bit. Decoding anything else raises `CodecError`, never another error.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from turnstile.jsontext import json_text
from turnstile.records import (
    ImageRef,
    MediaBlob,
    Reward,
    RolloutStatus,
    Timings,
    TokenSource,
    TurnRecord,
    TurnStatus,
)

# Bumped whenever a payload layout changes; older payloads are then refused, not guessed.
CODEC_VERSION = 1

_PREFIX = struct.Struct("<BI")  # codec version, header length
_I32 = np.dtype("<i4")
_I64 = np.dtype("<i8")
_F32 = np.dtype("<f4")
_F64 = np.dtype("<f8")


class EventKind(enum.IntEnum):
    """The frame kinds of the journal (one byte on disk: never renumber)."""

    TURN = 1
    ROLLOUT_CREATED = 2
    REWARDS_POSTED = 3
    ROLLOUT_SEALED = 4
    POLICY_VERSION_SET = 5


class CodecError(ValueError):
    """A payload is not a valid encoding of the expected event."""


@dataclass(frozen=True, slots=True)
class RolloutCreated:
    rollout_id: str
    group_id: str | None
    task_id: str | None
    metadata: dict[str, Any] | None  # JSON-compatible, as the client sent it
    implicit: bool
    created_at: float
    group_size: int | None = None  # older frames have none


@dataclass(frozen=True, slots=True)
class RewardsPosted:
    rollout_id: str
    rewards: dict[str, float]
    info: dict[str, str | None] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RolloutSealed:
    rollout_id: str
    status: RolloutStatus
    sealed_at: float


@dataclass(frozen=True, slots=True)
class PolicyVersionSet:
    policy_version: int
    set_at: float


# --- container -------------------------------------------------------------------------
def _pack(header: dict[str, Any], blocks: list[bytes | memoryview]) -> bytes:
    header["_b"] = [len(b) for b in blocks]
    try:
        head = json_text(header).encode("utf-8")
    except (TypeError, ValueError) as exc:  # unencodable value or invalid str
        raise CodecError(f"cannot encode event: {exc}") from exc
    return b"".join([_PREFIX.pack(CODEC_VERSION, len(head)), head, *blocks])


def _unpack(payload: bytes) -> tuple[dict[str, Any], list[memoryview]]:
    data = memoryview(payload)
    if len(data) < _PREFIX.size:
        raise CodecError("payload too short")
    version, head_len = _PREFIX.unpack_from(data)
    if version != CODEC_VERSION:
        raise CodecError(f"unknown codec version {version}")
    end = _PREFIX.size + head_len
    if end > len(data):
        raise CodecError("header runs past the payload")
    try:
        header = orjson.loads(data[_PREFIX.size : end])
    except orjson.JSONDecodeError as exc:
        raise CodecError(f"bad header: {exc}") from exc
    if not isinstance(header, dict):
        raise CodecError("header is not an object")
    sizes = header.get("_b")
    if not isinstance(sizes, list) or not all(type(s) is int and s >= 0 for s in sizes):
        raise CodecError("bad block table")
    blocks: list[memoryview] = []
    pos = end
    for size in sizes:
        blocks.append(data[pos : pos + size])
        pos += size
    if pos != len(data):
        raise CodecError("block sizes do not match the payload length")
    return header, blocks


def _array(block: memoryview, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    if len(block) % dtype.itemsize:
        raise CodecError(f"block of {len(block)} bytes is not a whole number of {dtype}")
    # A private copy in native order: writable, aligned, independent of the payload.
    return np.frombuffer(block, dtype=dtype).astype(dtype.newbyteorder("="))


def _raw(values: npt.NDArray[Any], dtype: np.dtype[Any], name: str) -> memoryview:
    """The bytes of an array, without a copy where it already has `dtype` (the token
    arrays of a turn do: the frame is joined straight from them)."""
    if values.ndim != 1:
        raise CodecError(f"{name} must be one-dimensional, not {values.shape}")
    if not np.can_cast(values.dtype, dtype, casting="safe"):
        raise CodecError(f"{name} has dtype {values.dtype}; it must cast safely to {dtype}")
    return np.ascontiguousarray(values, dtype=dtype).data.cast("B")


def _floats(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}d", *values)


def _unfloats(block: memoryview, count: int) -> tuple[float, ...]:
    if len(block) != 8 * count:
        raise CodecError(f"expected {count} floats, got {len(block)} bytes")
    return struct.unpack(f"<{count}d", block)


def _ragged(rows: list[list[Any]] | None, dtype: np.dtype[Any]) -> tuple[bytes, bytes]:
    if rows is None:
        return b"", b""
    lengths = np.fromiter((len(r) for r in rows), dtype=_I64, count=len(rows))
    flat = [v for r in rows for v in r]
    try:
        values = np.asarray(flat, dtype=dtype) if flat else np.empty(0, dtype)
    except (OverflowError, ValueError, TypeError) as exc:
        raise CodecError(f"cannot encode top-logprob rows: {exc}") from exc
    return lengths.tobytes(), values.tobytes()


def _unragged(lengths_b: memoryview, values_b: memoryview, dtype: np.dtype[Any]) -> list[list[Any]]:
    lengths = _array(lengths_b, _I64)
    values = _array(values_b, dtype)
    if (lengths < 0).any() or int(lengths.sum()) != values.shape[0]:
        raise CodecError("ragged row lengths do not match the values")
    flat = values.tolist()
    rows: list[list[Any]] = []
    pos = 0
    for n in lengths.tolist():
        rows.append(flat[pos : pos + n])
        pos += n
    return rows


def _field(header: dict[str, Any], key: str, *types: type) -> Any:
    value = header.get(key)
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise CodecError(f"field {key!r} is missing or has the wrong type")
    return value


def _enum(header: dict[str, Any], key: str, cls: type[enum.StrEnum]) -> Any:
    try:
        return cls(_field(header, key, str))
    except ValueError as exc:
        raise CodecError(f"field {key!r}: {exc}") from exc


_NONE = type(None)
_TURN_STRS = ("turn_id", "rollout_id", "endpoint", "model", "sampling_params_json")
_TURN_OPT_STRS = (
    "finish_reason",
    "stop_reason",
    "request_messages_json",
    "request_tools_json",
    "request_prompt_json",
    "response_message_json",
    "response_text",
    "error",
    "group_id",
)
_TURN_INTS = ("turn_index", "choice_index", "policy_version", "http_status")
_TURN_BLOCKS = 8  # token arrays, timings, top-k; then one block per image carried


# --- turns -----------------------------------------------------------------------------
def encode_turn(record: TurnRecord) -> bytes:
    """A `TurnRecord` as journal payload bytes (exact: see `decode_turn`)."""
    header: dict[str, Any] = {k: getattr(record, k) for k in _TURN_STRS + _TURN_OPT_STRS}
    header.update({k: int(getattr(record, k)) for k in _TURN_INTS})
    header["status"] = TurnStatus(record.status).value
    header["token_source"] = TokenSource(record.token_source).value
    t = record.timings
    header["ttft_none"] = t.ttft_s is None
    header["top_ids"] = record.top_logprob_ids is not None
    header["top_values"] = record.top_logprob_values is not None
    if record.backend is not None:  # absent in frames written before pools existed
        header["backend"] = record.backend
    if record.backend_failover_from is not None:
        header["backend_failover_from"] = record.backend_failover_from
    if record.policy_version_spans:  # absent in frames written before per-token versions
        header["policy_version_spans"] = [[int(a), int(v)] for a, v in record.policy_version_spans]
    if record.policy_switch_unlocated:
        header["policy_switch_unlocated"] = True
    if record.tito_context_faithful is not None:  # absent in record mode and older frames
        header["tito_context_faithful"] = record.tito_context_faithful
    if record.images:  # absent in calls without images and in older frames
        header["images"] = [[i.sha256, i.url, i.start, i.length] for i in record.images]
    if record.media:  # each image's bytes are one more block after the eight
        header["media"] = [[b.sha256, b.mime_type] for b in record.media]
    if record.processor_digest is not None:
        header["processor_digest"] = record.processor_digest
    ttft = 0.0 if t.ttft_s is None else t.ttft_s
    blocks: list[bytes | memoryview] = [
        _raw(record.prompt_token_ids, _I32, "prompt_token_ids"),
        _raw(record.completion_token_ids, _I32, "completion_token_ids"),
        _raw(record.behavior_logprobs, _F32, "behavior_logprobs"),
        _floats([t.received_at, t.queue_s, ttft, t.total_s]),
        *_ragged(record.top_logprob_ids, _I64),
        *_ragged(record.top_logprob_values, _F64),
        *(b.data for b in record.media),
    ]
    return _pack(header, blocks)


def decode_turn(data: bytes) -> TurnRecord:
    """The `TurnRecord` that `encode_turn` encoded; `CodecError` for anything else."""
    header, blocks = _unpack(data)
    media = _media(header, blocks[_TURN_BLOCKS:])
    if len(blocks) != _TURN_BLOCKS + len(media):
        raise CodecError(f"a turn has {_TURN_BLOCKS} blocks and one per image, not {len(blocks)}")
    received_at, queue_s, ttft, total_s = _unfloats(blocks[3], 4)
    ttft_none = _field(header, "ttft_none", bool)
    strs = {k: _field(header, k, str) for k in _TURN_STRS}
    opt_strs = {k: _field(header, k, str, _NONE) for k in _TURN_OPT_STRS}
    ints = {k: _field(header, k, int) for k in _TURN_INTS}
    top_ids = _unragged(blocks[4], blocks[5], _I64) if _field(header, "top_ids", bool) else None
    top_values = (
        _unragged(blocks[6], blocks[7], _F64) if _field(header, "top_values", bool) else None
    )
    return TurnRecord(
        **strs,
        **opt_strs,
        **ints,
        status=_enum(header, "status", TurnStatus),
        token_source=_enum(header, "token_source", TokenSource),
        prompt_token_ids=_array(blocks[0], _I32),
        completion_token_ids=_array(blocks[1], _I32),
        behavior_logprobs=_array(blocks[2], _F32),
        timings=Timings(received_at, queue_s, None if ttft_none else ttft, total_s),
        top_logprob_ids=top_ids,
        top_logprob_values=top_values,
        backend=_optional_str(header, "backend"),
        backend_failover_from=_optional_str(header, "backend_failover_from"),
        policy_version_spans=_version_spans(header),
        policy_switch_unlocated=_field(header, "policy_switch_unlocated", bool)
        if "policy_switch_unlocated" in header
        else False,
        tito_context_faithful=_optional_bool(header, "tito_context_faithful"),
        images=_images(header),
        media=media,
        processor_digest=_optional_str(header, "processor_digest"),
    )


def _images(header: dict[str, Any]) -> list[ImageRef]:
    """A turn's images; [] in frames without any (and frames written before images)."""
    out: list[ImageRef] = []
    for item in _field(header, "images", list) if "images" in header else []:
        if (
            not isinstance(item, list)
            or len(item) != 4
            or not all(x is None or type(x) is str for x in item[:2])
            or not all(x is None or type(x) is int for x in item[2:])
        ):
            raise CodecError(f"an image must be [hash, url, start, length], not {item!r:.80}")
        out.append(ImageRef(item[0], item[1], item[2], item[3]))
    return out


def _media(header: dict[str, Any], blocks: list[memoryview]) -> list[MediaBlob]:
    """The image bytes a turn carries: (hash, type) in the header, the bytes in blocks."""
    items = _field(header, "media", list) if "media" in header else []
    if len(items) != len(blocks):
        raise CodecError(f"a turn lists {len(items)} images but carries {len(blocks)} blocks")
    out: list[MediaBlob] = []
    for item, block in zip(items, blocks, strict=True):
        if not isinstance(item, list) or len(item) != 2 or not all(type(x) is str for x in item):
            raise CodecError(f"an image must be [hash, mime type], not {item!r:.80}")
        out.append(MediaBlob(item[0], item[1], bytes(block)))
    return out


def _version_spans(header: dict[str, Any]) -> list[tuple[int, int]]:
    """A turn's (first token, version) spans; [] in frames written before they existed."""
    if "policy_version_spans" not in header:
        return []
    spans = _field(header, "policy_version_spans", list)
    out: list[tuple[int, int]] = []
    for span in spans:
        if not isinstance(span, list) or len(span) != 2 or not all(type(x) is int for x in span):
            raise CodecError(f"a policy version span must be two integers, not {span!r:.60}")
        out.append((span[0], span[1]))
    return out


def _optional_bool(header: dict[str, Any], key: str) -> bool | None:
    """A boolean field that older frames (and record mode's) do not have."""
    value = header.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise CodecError(f"turn field {key!r} is {type(value).__name__}, not bool")
    return value


def _optional_str(header: dict[str, Any], key: str) -> str | None:
    """A string field that older frames do not have."""
    return _field(header, key, str, _NONE) if key in header else None


# --- rollout events ----------------------------------------------------------------------
def encode_rollout_created(event: RolloutCreated) -> bytes:
    header: dict[str, Any] = {
        "rollout_id": event.rollout_id,
        "group_id": event.group_id,
        "task_id": event.task_id,
        "metadata": event.metadata,
        "implicit": event.implicit,
    }
    if event.group_size is not None:
        header["group_size"] = event.group_size
    return _pack(header, [_floats([event.created_at])])


def decode_rollout_created(data: bytes) -> RolloutCreated:
    header, blocks = _unpack(data)
    if len(blocks) != 1:
        raise CodecError("a rollout-created event has 1 block")
    (created_at,) = _unfloats(blocks[0], 1)
    return RolloutCreated(
        rollout_id=_field(header, "rollout_id", str),
        group_id=_field(header, "group_id", str, _NONE),
        task_id=_field(header, "task_id", str, _NONE),
        metadata=_field(header, "metadata", dict, _NONE),
        implicit=_field(header, "implicit", bool),
        created_at=created_at,
        group_size=_field(header, "group_size", int) if "group_size" in header else None,
    )


def encode_rewards_posted(event: RewardsPosted) -> bytes:
    names = list(event.rewards)
    header = {"rollout_id": event.rollout_id, "names": names, "info": event.info}
    return _pack(header, [_floats([float(event.rewards[n]) for n in names])])


def decode_rewards_posted(data: bytes) -> RewardsPosted:
    header, blocks = _unpack(data)
    names = _field(header, "names", list)
    info = _field(header, "info", dict)
    if len(blocks) != 1 or not all(isinstance(n, str) for n in names):
        raise CodecError("bad rewards event")
    if not all(isinstance(v, str | None) for v in info.values()):
        raise CodecError("reward info values must be strings or null")
    values = _unfloats(blocks[0], len(names))
    return RewardsPosted(
        rollout_id=_field(header, "rollout_id", str),
        rewards=dict(zip(names, values, strict=True)),
        info=info,
    )


def rewards_from_event(event: RewardsPosted) -> list[Reward]:
    """The posted rewards as `Reward` rows (info attached by name)."""
    return [Reward(n, v, event.info.get(n)) for n, v in event.rewards.items()]


def encode_rollout_sealed(event: RolloutSealed) -> bytes:
    header = {"rollout_id": event.rollout_id, "status": RolloutStatus(event.status).value}
    return _pack(header, [_floats([event.sealed_at])])


def decode_rollout_sealed(data: bytes) -> RolloutSealed:
    header, blocks = _unpack(data)
    if len(blocks) != 1:
        raise CodecError("a rollout-sealed event has 1 block")
    (sealed_at,) = _unfloats(blocks[0], 1)
    return RolloutSealed(
        rollout_id=_field(header, "rollout_id", str),
        status=_enum(header, "status", RolloutStatus),
        sealed_at=sealed_at,
    )


def encode_policy_version_set(event: PolicyVersionSet) -> bytes:
    return _pack({"policy_version": int(event.policy_version)}, [_floats([event.set_at])])


def decode_policy_version_set(data: bytes) -> PolicyVersionSet:
    header, blocks = _unpack(data)
    if len(blocks) != 1:
        raise CodecError("a policy-version event has 1 block")
    (set_at,) = _unfloats(blocks[0], 1)
    return PolicyVersionSet(_field(header, "policy_version", int), set_at)


Event = TurnRecord | RolloutCreated | RewardsPosted | RolloutSealed | PolicyVersionSet


def encode_event(event: Event) -> tuple[EventKind, bytes]:
    """The frame kind and payload for any journal event."""
    if isinstance(event, TurnRecord):
        return EventKind.TURN, encode_turn(event)
    if isinstance(event, RolloutCreated):
        return EventKind.ROLLOUT_CREATED, encode_rollout_created(event)
    if isinstance(event, RewardsPosted):
        return EventKind.REWARDS_POSTED, encode_rewards_posted(event)
    if isinstance(event, RolloutSealed):
        return EventKind.ROLLOUT_SEALED, encode_rollout_sealed(event)
    return EventKind.POLICY_VERSION_SET, encode_policy_version_set(event)


def decode_event(kind: int, data: bytes) -> Event:
    """The event a frame of `kind` carries; `CodecError` for an unknown kind or bad bytes."""
    if kind == EventKind.TURN:
        return decode_turn(data)
    if kind == EventKind.ROLLOUT_CREATED:
        return decode_rollout_created(data)
    if kind == EventKind.REWARDS_POSTED:
        return decode_rewards_posted(data)
    if kind == EventKind.ROLLOUT_SEALED:
        return decode_rollout_sealed(data)
    if kind == EventKind.POLICY_VERSION_SET:
        return decode_policy_version_set(data)
    raise CodecError(f"unknown event kind {kind}")
