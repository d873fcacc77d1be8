"""The Parquet schema of Turnstile's output, declared once and versioned.

Every column of the data tables (`turns`, `samples`, `rollouts`, and `media`, the bytes
of recorded images once per content hash) and of the
`quarantine` table (rows that could not be written, kept with the reason) is described
exactly once, in the `Column` tuples below. Those tuples build the `pyarrow` schemas, the Parquet
write options (which columns get dictionary encoding and statistics) and the Markdown
reference (`schema_markdown`). Trainers code against these column names, so any change
to a name, a type or a meaning must bump `SCHEMA_VERSION`.

The `*_table` functions turn lists of records into `pyarrow.Table`s. Token columns are
built from concatenated numpy buffers plus offsets, never from Python lists of ints.
"""

from __future__ import annotations

import enum
import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from turnstile.records import (
    ImageRef,
    MediaRecord,
    QuarantineRecord,
    Reward,
    RolloutRecord,
    SampleRecord,
    TurnRecord,
    TurnSpan,
)

SCHEMA_VERSION: Final[int] = 4
# Versions a reader of this version reads: version 1 lacks the turns' `backend` and
# `backend_failover_from` columns, versions 1 and 2 the rollouts' `group_size`, versions
# 1 to 3 the per-token versions (`policy_version_spans`, `policy_switch_unlocated`),
# the turns' `tito_context_faithful`, the images (`image_spans`, `processor_digest`) and
# the `media` table; they read as null (and no media).
READABLE_SCHEMA_VERSIONS: Final[frozenset[int]] = frozenset({1, 2, 3, 4})

TableName = Literal["turns", "samples", "rollouts", "media", "quarantine"]
# The data tables a trainer reads.
TABLES: Final[tuple[TableName, ...]] = ("turns", "samples", "rollouts", "media")
MEDIA: Final = "media"
# Rows of the data tables that could not be written, each with its reason and the record
# itself: kept beside them, never dropped (`turnstile.output.quarantine`).
QUARANTINE: Final = "quarantine"
ALL_TABLES: Final[tuple[TableName, ...]] = (*TABLES, QUARANTINE)

META_PREFIX: Final[str] = "turnstile."
META_SCHEMA_VERSION: Final[str] = "turnstile.schema_version"
META_TABLE: Final[str] = "turnstile.table"
META_MODEL: Final[str] = "turnstile.model"
META_TOKENIZER: Final[str] = "turnstile.tokenizer"
META_WRITER: Final[str] = "turnstile.writer"

_RESERVED_META: Final[frozenset[str]] = frozenset({META_SCHEMA_VERSION, META_TABLE})
_INT32_MAX: Final[int] = 2**31 - 1
_MICROS: Final[float] = 1e6


@dataclass(frozen=True, slots=True)
class Column:
    """One column: its name, Arrow type, nullability and meaning.

    `text` marks free-form text (JSON documents, sampled text, error messages): such
    columns get neither dictionary encoding nor min/max statistics.
    """

    name: str
    type: pa.DataType
    nullable: bool
    description: str
    text: bool = False

    def field(self) -> pa.Field:
        return pa.field(self.name, self.type, nullable=self.nullable)

    @property
    def nested(self) -> bool:
        return bool(pa.types.is_nested(self.type))

    @property
    def dictionary(self) -> bool:
        """Low-cardinality strings (statuses, ids, model names) are dictionary-encoded."""
        return bool(pa.types.is_string(self.type)) and not self.text

    @property
    def statistics(self) -> bool:
        """Scalar columns carry min/max statistics so filters can skip row groups."""
        return not self.nested and not self.text


REWARD_TYPE: Final[pa.StructType] = pa.struct(
    [
        pa.field("name", pa.string(), nullable=False),
        pa.field("value", pa.float64(), nullable=False),
        pa.field("info", pa.string(), nullable=True),
    ]
)
REWARDS_TYPE: Final[pa.ListType] = pa.list_(REWARD_TYPE)

TURN_SPAN_TYPE: Final[pa.StructType] = pa.struct(
    [
        pa.field("turn_index", pa.int32(), nullable=False),
        pa.field("choice_index", pa.int32(), nullable=False),
        pa.field("prompt_start", pa.int32(), nullable=False),
        pa.field("completion_start", pa.int32(), nullable=False),
        pa.field("completion_end", pa.int32(), nullable=False),
    ]
)
TURN_SPANS_TYPE: Final[pa.ListType] = pa.list_(TURN_SPAN_TYPE)

VERSION_SPAN_TYPE: Final[pa.StructType] = pa.struct(
    [
        pa.field("start", pa.int32(), nullable=False),
        pa.field("version", pa.int64(), nullable=False),
    ]
)
VERSION_SPANS_TYPE: Final[pa.ListType] = pa.list_(VERSION_SPAN_TYPE)

IMAGE_SPAN_TYPE: Final[pa.StructType] = pa.struct(
    [
        pa.field("sha256", pa.string(), nullable=True),
        pa.field("url", pa.string(), nullable=True),
        pa.field("start", pa.int32(), nullable=True),
        pa.field("length", pa.int32(), nullable=True),
    ]
)
IMAGE_SPANS_TYPE: Final[pa.ListType] = pa.list_(IMAGE_SPAN_TYPE)

_TS: Final[pa.DataType] = pa.timestamp("us", tz="UTC")
_STR: Final[pa.DataType] = pa.string()
_I32: Final[pa.DataType] = pa.int32()
_I64: Final[pa.DataType] = pa.int64()
_F64: Final[pa.DataType] = pa.float64()
_TOKENS: Final[pa.DataType] = pa.list_(pa.int32())
_LOGPROBS: Final[pa.DataType] = pa.list_(pa.float32())
_VERSIONS: Final[pa.DataType] = pa.list_(pa.int64())

_REWARDS_DOC = "Named rewards: `name`, `value`, optional verifier `info` (text or JSON)."
_REWARD_DOC = "Sum of `rewards.value`; null when there are no rewards."

TURNS_COLUMNS: Final[tuple[Column, ...]] = (
    Column("turn_id", _STR, False, "Unique id of the backend call; its choices share it."),
    Column("rollout_id", _STR, False, "Rollout the call belongs to."),
    Column("group_id", _STR, True, "Group of rollouts (e.g. GRPO group), if given."),
    Column("turn_index", _I32, False, "Order of the call within the rollout (from 0)."),
    Column("choice_index", _I32, False, "Choice index within the call (n > 1)."),
    Column("endpoint", _STR, False, "`chat.completions` or `completions`."),
    Column("model", _STR, False, "Model name the backend served."),
    Column("policy_version", _I64, False, "Policy (weights) version that sampled it."),
    Column("status", _STR, False, "How the call ended: `ok`, `aborted` or `error`."),
    Column("http_status", _I32, False, "HTTP status of the backend response."),
    Column("error", _STR, True, "Error message when the call failed.", text=True),
    Column("token_source", _STR, False, "`backend` (exact), `retokenized` or `none`."),
    Column("finish_reason", _STR, True, "Backend finish reason (`stop`, `length`, ...)."),
    Column("stop_reason", _STR, True, "Stop string or token that ended sampling."),
    Column("num_prompt_tokens", _I32, False, "Length of `prompt_token_ids`."),
    Column("num_completion_tokens", _I32, False, "Length of `completion_token_ids`."),
    Column("prompt_token_ids", _TOKENS, False, "Token ids the backend consumed."),
    Column("completion_token_ids", _TOKENS, False, "Token ids the backend sampled."),
    Column(
        "behavior_logprobs",
        _LOGPROBS,
        False,
        "Log-probability of each completion token under the sampler (NaN: unknown).",
    ),
    Column(
        "top_logprob_ids",
        pa.list_(_TOKENS),
        True,
        "Top-k alternative token ids per completion token; null when not recorded.",
    ),
    Column(
        "top_logprob_values",
        pa.list_(_LOGPROBS),
        True,
        "Log-probabilities aligned with `top_logprob_ids`; null when not recorded.",
    ),
    Column("request_messages_json", _STR, True, "Chat request messages (JSON).", text=True),
    Column("request_tools_json", _STR, True, "Chat request tools (JSON).", text=True),
    Column("request_prompt_json", _STR, True, "Completions request prompt (JSON).", text=True),
    Column(
        "response_message_json",
        _STR,
        True,
        "Chat response message: content, reasoning, tool calls (JSON).",
        text=True,
    ),
    Column("response_text", _STR, True, "Completions response text.", text=True),
    Column("sampling_params_json", _STR, False, "Sampling parameters sent (JSON).", text=True),
    Column("received_at", _TS, False, "When the request reached Turnstile (UTC)."),
    Column("queue_s", _F64, False, "Seconds from receipt until sent upstream."),
    Column("ttft_s", _F64, True, "Seconds from receipt until the first completion byte."),
    Column("total_s", _F64, False, "Seconds from receipt until the call ended."),
    Column(
        "backend",
        _STR,
        True,
        "With several backends: base URL of the one that served the call; else null.",
    ),
    Column(
        "backend_failover_from",
        _STR,
        True,
        "Base URL of the dead backend the rollout was moved away from by this call; "
        "null when the call stayed on its rollout's backend.",
    ),
    Column(
        "policy_version_spans",
        VERSION_SPANS_TYPE,
        True,
        "Per-token policy versions: (`start`, `version`) runs, `start` the index of the "
        "run's first token in `completion_token_ids`, in order, the first at 0. A stream's "
        "tokens received after a `keep` switch carry the new version; `policy_version` "
        "stays the version current when the call began. Null in shards before version 4.",
    ),
    Column(
        "policy_switch_unlocated",
        pa.bool_(),
        True,
        "True for a whole (non-streamed) call that a policy switch fell inside: its tokens "
        "are all recorded under the version it began with, but the later ones may have "
        "been sampled by the next (with `stream_whole_calls` on, the switch is placed). "
        "Null in shards before version 4.",
    ),
    Column(
        "tito_context_faithful",
        pa.bool_(),
        True,
        "TITO mode: whether the prompt equals what the chat template renders for the "
        "request's messages (false: e.g. earlier reasoning the template drops, or "
        "tool-call arguments it re-serialises; the tokens are still what the model "
        "consumed); null in record mode.",
    ),
    Column(
        "image_spans",
        IMAGE_SPANS_TYPE,
        True,
        "The request's images in order: `sha256` of the bytes in the `media` table (null "
        "for a remote image recorded by URL only), `url` the remote URL it came from (null "
        "for inline data), and its placeholder tokens `start`..`start + length` in "
        "`prompt_token_ids` (null where they could not be located: no image token id "
        "configured, or runs that do not match the images). Empty without images; null "
        "in shards before version 4.",
    ),
    Column(
        "processor_digest",
        _STR,
        True,
        "Turns with images: SHA-256 of the model's image-processor configuration the "
        "images were processed with (`turnstile.images.processor_digest`); null when none "
        "was configured, and for turns without images.",
    ),
)

SAMPLES_COLUMNS: Final[tuple[Column, ...]] = (
    Column("rollout_id", _STR, False, "Rollout the sample was stitched from."),
    Column("sample_index", _I32, False, "Order of the sample within the rollout (from 0)."),
    Column("group_id", _STR, True, "Group of rollouts (e.g. GRPO group), if given."),
    Column("task_id", _STR, True, "Task or prompt id, if given."),
    Column("rollout_status", _STR, False, "`finished`, `abandoned` or `interrupted`."),
    Column("token_source", _STR, False, "`backend` (exact), `retokenized` or `none`."),
    Column("num_tokens", _I32, False, "Length of `input_ids`."),
    Column("num_loss_tokens", _I32, False, "Number of ones in `loss_mask`."),
    Column("input_ids", _TOKENS, False, "The stitched token sequence."),
    Column("loss_mask", pa.list_(pa.int8()), False, "1 exactly on sampled tokens, else 0."),
    Column(
        "behavior_logprobs",
        _LOGPROBS,
        False,
        "Sampler log-probability aligned with `input_ids`; NaN where `loss_mask` is 0.",
    ),
    Column("rewards", REWARDS_TYPE, False, _REWARDS_DOC),
    Column("reward", _F64, True, _REWARD_DOC),
    Column("num_turns", _I32, False, "Number of turns stitched into the sample."),
    Column(
        "turn_spans",
        TURN_SPANS_TYPE,
        False,
        "Per turn: where its new prompt tokens and its completion sit in `input_ids` "
        "(`completion_end` exclusive).",
    ),
    Column("turn_statuses", pa.list_(_STR), False, "Status of each stitched turn."),
    Column("policy_versions", _VERSIONS, False, "Policy version of each stitched turn."),
    Column("min_policy_version", _I64, True, "Smallest of `policy_versions`."),
    Column("max_policy_version", _I64, True, "Largest of `policy_versions`."),
    Column(
        "policy_version_spans",
        VERSION_SPANS_TYPE,
        True,
        "Per-token behaviour versions of the sampled tokens: (`start`, `version`) runs, "
        "`start` an index in `input_ids`; a run lasts until the next run or the end of its "
        "turn's completion (`turn_spans`). Prompt tokens (loss mask 0) carry no version. "
        "Null in shards before version 4.",
    ),
    Column(
        "image_spans",
        IMAGE_SPANS_TYPE,
        True,
        "The images of the stitched turns, each placeholder run once, in order: `sha256` "
        "in the `media` table, `url`, and `start`..`start + length` in `input_ids`. A "
        "sample extends a turn only where the images it shares with it sit at the same "
        "places. Null in shards before version 4.",
    ),
    Column(
        "break_kind",
        _STR,
        False,
        "Why this sample starts: `first`, or why the previous sample could not be "
        "extended (`history_rewritten`, `rerender`, `tokenization`, `truncated`, "
        "`token_source`, `branch`, `images`, `unclassified`).",
    ),
    Column("break_position", _I32, True, "Index of the first mismatching token, if any."),
    Column("break_detail", _STR, True, "Human-readable detail on the break.", text=True),
    Column("parent_sample_index", _I32, True, "Sample this one breaks away from."),
)

ROLLOUTS_COLUMNS: Final[tuple[Column, ...]] = (
    Column("rollout_id", _STR, False, "Rollout id."),
    Column("group_id", _STR, True, "Group of rollouts (e.g. GRPO group), if given."),
    Column(
        "group_size",
        _I32,
        True,
        "Rollouts in the group, as declared when they were created; null if not declared.",
    ),
    Column("task_id", _STR, True, "Task or prompt id, if given."),
    Column("status", _STR, False, "`finished`, `abandoned` or `interrupted`."),
    Column("rewards", REWARDS_TYPE, False, _REWARDS_DOC),
    Column("reward", _F64, True, _REWARD_DOC),
    Column("metadata", _STR, True, "Client-supplied rollout metadata (JSON).", text=True),
    Column("num_turns", _I32, False, "Number of turns (backend call choices) recorded."),
    Column("num_samples", _I32, False, "Number of training samples stitched."),
    Column("num_breaks", _I32, False, "Number of samples that start at a break."),
    Column("created_at", _TS, False, "When the rollout was opened (UTC)."),
    Column("sealed_at", _TS, False, "When the rollout was sealed (UTC)."),
    Column("policy_versions", _VERSIONS, False, "Policy versions seen in the rollout."),
    Column("min_policy_version", _I64, True, "Smallest of `policy_versions`."),
    Column("max_policy_version", _I64, True, "Largest of `policy_versions`."),
)

MEDIA_COLUMNS: Final[tuple[Column, ...]] = (
    Column("sha256", _STR, False, "SHA-256 of `data` (hex): how turns and samples name it."),
    Column("mime_type", _STR, False, "`image/png`, `image/jpeg`, `image/gif` or `image/webp`."),
    Column("size", _I64, False, "Length of `data` in bytes."),
    Column(
        "data", pa.large_binary(), False, "The image bytes as the backend received them.", text=True
    ),
    Column("rollout_id", _STR, False, "The rollout whose call first brought the image."),
    Column("stored_at", _TS, False, "When the row was written (UTC)."),
)

QUARANTINE_COLUMNS: Final[tuple[Column, ...]] = (
    Column("quarantined_at", _TS, False, "When the row was quarantined (UTC)."),
    Column("table", _STR, False, "The table the row was meant for: `turns`, `samples`, ..."),
    Column("rollout_id", _STR, True, "Rollout of the row, when known.", text=True),
    Column("turn_id", _STR, True, "Turn id of a `turns` row.", text=True),
    Column("choice_index", _I64, True, "Choice index of a `turns` row."),
    Column("sample_index", _I64, True, "Sample index of a `samples` row."),
    Column("reason", _STR, False, "Why the row could not be written.", text=True),
    Column(
        "record_format",
        _STR,
        False,
        "How `record` is encoded: `journal` (a turn's journal frame payload, "
        "`turnstile.journal.codec.decode_turn`) or `json`.",
    ),
    Column("record", pa.large_binary(), False, "The row as it was to be written."),
)

COLUMNS: Final[Mapping[TableName, tuple[Column, ...]]] = {
    "turns": TURNS_COLUMNS,
    "samples": SAMPLES_COLUMNS,
    "rollouts": ROLLOUTS_COLUMNS,
    "media": MEDIA_COLUMNS,
    "quarantine": QUARANTINE_COLUMNS,
}


def schema_metadata(table: TableName, identity: Mapping[str, str] | None = None) -> dict[str, str]:
    """Schema-level metadata: version, table name and the writer's identity.

    `identity` keys without the `turnstile.` prefix get it (`model` becomes
    `turnstile.model`); they may not override the version or the table name.
    """
    if table not in COLUMNS:
        raise ValueError(f"unknown table {table!r}; expected one of {TABLES}")
    meta = {META_SCHEMA_VERSION: str(SCHEMA_VERSION), META_TABLE: table}
    for key, value in (identity or {}).items():
        full = key if key.startswith(META_PREFIX) else META_PREFIX + key
        if full in _RESERVED_META:
            raise ValueError(f"identity may not set {full!r}")
        meta[full] = str(value)
    return meta


def _schema(table: TableName) -> pa.Schema:
    return pa.schema([c.field() for c in COLUMNS[table]], metadata=schema_metadata(table))


TURNS_SCHEMA: Final[pa.Schema] = _schema("turns")
SAMPLES_SCHEMA: Final[pa.Schema] = _schema("samples")
ROLLOUTS_SCHEMA: Final[pa.Schema] = _schema("rollouts")
MEDIA_SCHEMA: Final[pa.Schema] = _schema("media")
QUARANTINE_SCHEMA: Final[pa.Schema] = _schema("quarantine")
SCHEMAS: Final[Mapping[TableName, pa.Schema]] = {
    "turns": TURNS_SCHEMA,
    "samples": SAMPLES_SCHEMA,
    "rollouts": ROLLOUTS_SCHEMA,
    "media": MEDIA_SCHEMA,
    "quarantine": QUARANTINE_SCHEMA,
}


def dictionary_columns(table: TableName) -> list[str]:
    """Columns to dictionary-encode in Parquet (never the token lists)."""
    return [c.name for c in COLUMNS[table] if c.dictionary]


def statistics_columns(table: TableName) -> list[str]:
    """Columns that get Parquet min/max statistics (scalar, non-text columns)."""
    return [c.name for c in COLUMNS[table] if c.statistics]


def _type_text(arrow_type: pa.DataType) -> str:
    text = str(arrow_type).replace("item: ", "")
    return re.sub(r"\bdouble\b", "float64", re.sub(r"\bfloat\b", "float32", text))


def schema_markdown() -> str:
    """A Markdown reference of every table, column, type and meaning."""
    lines = [f"Schema version {SCHEMA_VERSION}.", ""]
    for table in ALL_TABLES:
        lines += [f"### `{table}`", "", "| column | type | null | meaning |", "|---|---|---|---|"]
        for c in COLUMNS[table]:
            type_text = _type_text(c.type)
            null = "yes" if c.nullable else "no"
            lines.append(f"| `{c.name}` | `{type_text}` | {null} | {c.description} |")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- array builders


def _text(value: object) -> str:
    return value.value if isinstance(value, enum.Enum) else str(value)


def _offsets(lengths: npt.NDArray[np.int64]) -> pa.Array:
    offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > _INT32_MAX:
        raise ValueError(
            f"{int(offsets[-1])} list values in one batch exceed the int32 offset range; "
            "write fewer rows per shard"
        )
    return pa.array(offsets.astype(np.int32))


def _numpy_list(
    arrays: Sequence[npt.NDArray[np.generic]], dtype: type[np.generic], arrow_type: pa.DataType
) -> pa.Array:
    """A list column from per-row 1-D numpy arrays, via one concatenation."""
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))
    if arrays:
        values = np.concatenate(arrays, dtype=dtype, casting="same_kind")
    else:
        values = np.empty(0, dtype=dtype)
    if values.ndim != 1 or values.shape[0] != int(lengths.sum()):
        raise ValueError("list columns need one 1-D array per row")
    return pa.ListArray.from_arrays(_offsets(lengths), pa.array(values), type=arrow_type)


def _sequence_list(
    rows: Sequence[Sequence[int]], dtype: type[np.generic], arrow_type: pa.DataType
) -> pa.Array:
    """A list column from short per-row sequences of numbers."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    values = np.fromiter(itertools.chain.from_iterable(rows), dtype=dtype, count=int(lengths.sum()))
    return pa.ListArray.from_arrays(_offsets(lengths), pa.array(values), type=arrow_type)


def _nested_list(
    rows: Sequence[Sequence[Sequence[float]] | None],
    dtype: type[np.generic],
    arrow_type: pa.ListType,
) -> pa.Array:
    """A nullable list<list<...>> column (top-k alternatives) from nested sequences.

    Each row may be a 2-D numpy array or a list of lists; rectangular rows (the same k
    for every token) take a fast path through numpy, ragged rows are flattened.
    """
    null = np.zeros(len(rows), dtype=np.bool_)
    outer = np.zeros(len(rows), dtype=np.int64)
    inner_lengths: list[npt.NDArray[np.int64]] = []
    values: list[npt.NDArray[np.generic]] = []
    for i, row in enumerate(rows):
        if row is None:
            null[i] = True
            continue
        outer[i] = len(row)
        if not len(row):
            continue
        try:
            block: npt.NDArray[np.generic] | None = np.asarray(row, dtype=dtype)
        except ValueError:
            block = None
        if block is not None and block.ndim == 2:
            inner_lengths.append(np.full(block.shape[0], block.shape[1], dtype=np.int64))
            values.append(block.reshape(-1))
        else:
            lengths = np.fromiter(map(len, row), dtype=np.int64, count=len(row))
            inner_lengths.append(lengths)
            flat = itertools.chain.from_iterable(row)
            values.append(np.fromiter(flat, dtype=dtype, count=int(lengths.sum())))
    flat_values = np.concatenate(values) if values else np.empty(0, dtype=dtype)
    lengths_all = np.concatenate(inner_lengths) if inner_lengths else np.empty(0, np.int64)
    inner = pa.ListArray.from_arrays(
        _offsets(lengths_all), pa.array(flat_values), type=arrow_type.value_type
    )
    mask = pa.array(null) if null.any() else None
    return pa.ListArray.from_arrays(_offsets(outer), inner, type=arrow_type, mask=mask)


def _struct_list(
    rows: Sequence[Sequence[object]], arrow_type: pa.ListType, children: Sequence[list[object]]
) -> pa.Array:
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    struct_type = arrow_type.value_type
    fields = [struct_type.field(i) for i in range(struct_type.num_fields)]
    arrays = [pa.array(values, type=f.type) for values, f in zip(children, fields, strict=True)]
    structs = pa.StructArray.from_arrays(arrays, fields=fields)
    return pa.ListArray.from_arrays(_offsets(lengths), structs, type=arrow_type)


def _rewards(rows: Sequence[Sequence[Reward]]) -> pa.Array:
    flat = [r for row in rows for r in row]
    children: list[list[object]] = [
        [r.name for r in flat],
        [float(r.value) for r in flat],
        [r.info for r in flat],
    ]
    return _struct_list(rows, REWARDS_TYPE, children)


def _reward_sum(rewards: Sequence[Reward]) -> float | None:
    return float(sum(float(r.value) for r in rewards)) if rewards else None


def _turn_spans(rows: Sequence[Sequence[TurnSpan]]) -> pa.Array:
    flat = [s for row in rows for s in row]
    children: list[list[object]] = [
        [s.turn_index for s in flat],
        [s.choice_index for s in flat],
        [s.prompt_start for s in flat],
        [s.completion_start for s in flat],
        [s.completion_end for s in flat],
    ]
    return _struct_list(rows, TURN_SPANS_TYPE, children)


def _version_spans(rows: Sequence[Sequence[tuple[int, int]]]) -> pa.Array:
    flat = [s for row in rows for s in row]
    children: list[list[object]] = [[s[0] for s in flat], [s[1] for s in flat]]
    return _struct_list(rows, VERSION_SPANS_TYPE, children)


def _image_spans(rows: Sequence[Sequence[ImageRef]]) -> pa.Array:
    flat = [i for row in rows for i in row]
    children: list[list[object]] = [
        [i.sha256 for i in flat],
        [i.url for i in flat],
        [i.start for i in flat],
        [i.length for i in flat],
    ]
    return _struct_list(rows, IMAGE_SPANS_TYPE, children)


def _strings(values: Sequence[str | None]) -> pa.Array:
    return pa.array(values, type=pa.string())


def _string_lists(rows: Sequence[Sequence[object]]) -> pa.Array:
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    flat = _strings([_text(v) for row in rows for v in row])
    return pa.ListArray.from_arrays(_offsets(lengths), flat, type=pa.list_(pa.string()))


def _timestamps(seconds: Sequence[float]) -> pa.Array:
    micros = np.rint(np.asarray(seconds, dtype=np.float64) * _MICROS).astype(np.int64)
    return pa.array(micros, type=_TS)


def _table(
    table: TableName, arrays: Mapping[str, pa.Array], identity: Mapping[str, str] | None
) -> pa.Table:
    schema = SCHEMAS[table].with_metadata(schema_metadata(table, identity))
    return pa.Table.from_arrays([arrays[c.name] for c in COLUMNS[table]], schema=schema)


# ---------------------------------------------------------------- tables


def turns_table(
    records: Sequence[TurnRecord], *, identity: Mapping[str, str] | None = None
) -> pa.Table:
    """The `turns` table for `records`, one row per record."""
    for r in records:
        if r.behavior_logprobs.shape[0] != r.completion_token_ids.shape[0]:
            raise ValueError(
                f"turn {r.turn_id} choice {r.choice_index}: {r.behavior_logprobs.shape[0]} "
                f"logprobs for {r.completion_token_ids.shape[0]} completion tokens"
            )
    i32, i64, f64 = pa.int32(), pa.int64(), pa.float64()
    arrays = {
        "turn_id": _strings([r.turn_id for r in records]),
        "rollout_id": _strings([r.rollout_id for r in records]),
        "group_id": _strings([r.group_id for r in records]),
        "turn_index": pa.array([r.turn_index for r in records], type=i32),
        "choice_index": pa.array([r.choice_index for r in records], type=i32),
        "endpoint": _strings([r.endpoint for r in records]),
        "model": _strings([r.model for r in records]),
        "policy_version": pa.array([r.policy_version for r in records], type=i64),
        "status": _strings([_text(r.status) for r in records]),
        "http_status": pa.array([r.http_status for r in records], type=i32),
        "error": _strings([r.error for r in records]),
        "token_source": _strings([_text(r.token_source) for r in records]),
        "finish_reason": _strings([r.finish_reason for r in records]),
        "stop_reason": _strings([r.stop_reason for r in records]),
        "num_prompt_tokens": pa.array([r.prompt_token_ids.shape[0] for r in records], type=i32),
        "num_completion_tokens": pa.array(
            [r.completion_token_ids.shape[0] for r in records], type=i32
        ),
        "prompt_token_ids": _numpy_list([r.prompt_token_ids for r in records], np.int32, _TOKENS),
        "completion_token_ids": _numpy_list(
            [r.completion_token_ids for r in records], np.int32, _TOKENS
        ),
        "behavior_logprobs": _numpy_list(
            [r.behavior_logprobs for r in records], np.float32, _LOGPROBS
        ),
        "top_logprob_ids": _nested_list(
            [r.top_logprob_ids for r in records], np.int32, pa.list_(_TOKENS)
        ),
        "top_logprob_values": _nested_list(
            [r.top_logprob_values for r in records], np.float32, pa.list_(_LOGPROBS)
        ),
        "request_messages_json": _strings([r.request_messages_json for r in records]),
        "request_tools_json": _strings([r.request_tools_json for r in records]),
        "request_prompt_json": _strings([r.request_prompt_json for r in records]),
        "response_message_json": _strings([r.response_message_json for r in records]),
        "response_text": _strings([r.response_text for r in records]),
        "sampling_params_json": _strings([r.sampling_params_json for r in records]),
        "received_at": _timestamps([r.timings.received_at for r in records]),
        "queue_s": pa.array([r.timings.queue_s for r in records], type=f64),
        "ttft_s": pa.array([r.timings.ttft_s for r in records], type=f64),
        "total_s": pa.array([r.timings.total_s for r in records], type=f64),
        "backend": _strings([r.backend for r in records]),
        "backend_failover_from": _strings([r.backend_failover_from for r in records]),
        "policy_version_spans": _version_spans([r.version_spans() for r in records]),
        "policy_switch_unlocated": pa.array(
            [r.policy_switch_unlocated for r in records], type=pa.bool_()
        ),
        "tito_context_faithful": pa.array(
            [r.tito_context_faithful for r in records], type=pa.bool_()
        ),
        "image_spans": _image_spans([r.images for r in records]),
        "processor_digest": _strings([r.processor_digest for r in records]),
    }
    return _table("turns", arrays, identity)


def samples_table(
    records: Sequence[SampleRecord], *, identity: Mapping[str, str] | None = None
) -> pa.Table:
    """The `samples` table for `records`, one row per record."""
    for r in records:
        n = r.input_ids.shape[0]
        if r.loss_mask.shape[0] != n or r.behavior_logprobs.shape[0] != n:
            raise ValueError(
                f"sample {r.rollout_id}/{r.sample_index}: input_ids, loss_mask and "
                f"behavior_logprobs lengths differ ({n}, {r.loss_mask.shape[0]}, "
                f"{r.behavior_logprobs.shape[0]})"
            )
    i32, i64, f64 = pa.int32(), pa.int64(), pa.float64()
    arrays = {
        "rollout_id": _strings([r.rollout_id for r in records]),
        "sample_index": pa.array([r.sample_index for r in records], type=i32),
        "group_id": _strings([r.group_id for r in records]),
        "task_id": _strings([r.task_id for r in records]),
        "rollout_status": _strings([_text(r.rollout_status) for r in records]),
        "token_source": _strings([_text(r.token_source) for r in records]),
        "num_tokens": pa.array([r.input_ids.shape[0] for r in records], type=i32),
        "num_loss_tokens": pa.array([np.count_nonzero(r.loss_mask) for r in records], type=i32),
        "input_ids": _numpy_list([r.input_ids for r in records], np.int32, _TOKENS),
        "loss_mask": _numpy_list([r.loss_mask for r in records], np.int8, pa.list_(pa.int8())),
        "behavior_logprobs": _numpy_list(
            [r.behavior_logprobs for r in records], np.float32, _LOGPROBS
        ),
        "rewards": _rewards([r.rewards for r in records]),
        "reward": pa.array([_reward_sum(r.rewards) for r in records], type=f64),
        "num_turns": pa.array([len(r.turn_spans) for r in records], type=i32),
        "turn_spans": _turn_spans([r.turn_spans for r in records]),
        "turn_statuses": _string_lists([r.turn_statuses for r in records]),
        "policy_versions": _sequence_list(
            [r.policy_versions for r in records], np.int64, _VERSIONS
        ),
        "min_policy_version": pa.array(
            [min(r.policy_versions, default=None) for r in records], type=i64
        ),
        "max_policy_version": pa.array(
            [max(r.policy_versions, default=None) for r in records], type=i64
        ),
        "policy_version_spans": _version_spans([r.policy_version_spans for r in records]),
        "image_spans": _image_spans([r.images for r in records]),
        "break_kind": _strings([_text(r.break_kind) for r in records]),
        "break_position": pa.array([r.break_position for r in records], type=i32),
        "break_detail": _strings([r.break_detail for r in records]),
        "parent_sample_index": pa.array([r.parent_sample_index for r in records], type=i32),
    }
    return _table("samples", arrays, identity)


def rollouts_table(
    records: Sequence[RolloutRecord], *, identity: Mapping[str, str] | None = None
) -> pa.Table:
    """The `rollouts` table for `records`, one row per record."""
    i32, i64 = pa.int32(), pa.int64()
    arrays = {
        "rollout_id": _strings([r.rollout_id for r in records]),
        "group_id": _strings([r.group_id for r in records]),
        "group_size": pa.array([r.group_size for r in records], type=i32),
        "task_id": _strings([r.task_id for r in records]),
        "status": _strings([_text(r.status) for r in records]),
        "rewards": _rewards([r.rewards for r in records]),
        "reward": pa.array([_reward_sum(r.rewards) for r in records], type=pa.float64()),
        "metadata": _strings([r.metadata_json for r in records]),
        "num_turns": pa.array([r.num_turns for r in records], type=i32),
        "num_samples": pa.array([r.num_samples for r in records], type=i32),
        "num_breaks": pa.array([r.num_breaks for r in records], type=i32),
        "created_at": _timestamps([r.created_at for r in records]),
        "sealed_at": _timestamps([r.sealed_at for r in records]),
        "policy_versions": _sequence_list(
            [r.policy_versions for r in records], np.int64, _VERSIONS
        ),
        "min_policy_version": pa.array(
            [min(r.policy_versions, default=None) for r in records], type=i64
        ),
        "max_policy_version": pa.array(
            [max(r.policy_versions, default=None) for r in records], type=i64
        ),
    }
    return _table("rollouts", arrays, identity)


def media_table(
    records: Sequence[MediaRecord], *, identity: Mapping[str, str] | None = None
) -> pa.Table:
    """The `media` table for `records`, one row per record."""
    arrays = {
        "sha256": _strings([r.sha256 for r in records]),
        "mime_type": _strings([r.mime_type for r in records]),
        "size": pa.array([len(r.data) for r in records], type=pa.int64()),
        "data": pa.array([r.data for r in records], type=pa.large_binary()),
        "rollout_id": _strings([r.rollout_id for r in records]),
        "stored_at": _timestamps([r.stored_at for r in records]),
    }
    return _table("media", arrays, identity)


def quarantine_table(
    records: Sequence[QuarantineRecord], *, identity: Mapping[str, str] | None = None
) -> pa.Table:
    """The `quarantine` table for `records`, one row per record."""
    arrays = {
        "quarantined_at": _timestamps([r.quarantined_at for r in records]),
        "table": _strings([r.table for r in records]),
        "rollout_id": _strings([r.rollout_id for r in records]),
        "turn_id": _strings([r.turn_id for r in records]),
        "choice_index": pa.array([r.choice_index for r in records], type=pa.int64()),
        "sample_index": pa.array([r.sample_index for r in records], type=pa.int64()),
        "reason": _strings([r.reason for r in records]),
        "record_format": _strings([r.record_format for r in records]),
        "record": pa.array([r.record for r in records], type=pa.large_binary()),
    }
    return _table("quarantine", arrays, identity)
