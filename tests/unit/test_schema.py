"""The Parquet schema is pinned, and records survive the trip into Arrow unchanged."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from tests.fakes_sink import make_rollout, make_sample, make_turn
from turnstile.output.schema import (
    ALL_TABLES,
    COLUMNS,
    ROLLOUTS_SCHEMA,
    SAMPLES_SCHEMA,
    SCHEMA_VERSION,
    SCHEMAS,
    TABLES,
    TURNS_SCHEMA,
    dictionary_columns,
    rollouts_table,
    samples_table,
    schema_markdown,
    schema_metadata,
    statistics_columns,
    turns_table,
)
from turnstile.records import Reward, RolloutStatus, TokenSource, TurnSpan, TurnStatus

# Trainers code against these columns. When changing any of them, bump SCHEMA_VERSION in
# turnstile/schema.py and update these lists (and the version below) in the same change.
REWARDS = "list<item: struct<name: string not null, value: double not null, info: string>>"
TURN_SPANS = (
    "list<item: struct<turn_index: int32 not null, choice_index: int32 not null, "
    "prompt_start: int32 not null, completion_start: int32 not null, "
    "completion_end: int32 not null>>"
)
VERSION_SPANS = "list<item: struct<start: int32 not null, version: int64 not null>>"
IMAGE_SPANS = "list<item: struct<sha256: string, url: string, start: int32, length: int32>>"
EXPECTED_TURNS = [
    ("turn_id", "string", False),
    ("rollout_id", "string", False),
    ("group_id", "string", True),
    ("turn_index", "int32", False),
    ("choice_index", "int32", False),
    ("endpoint", "string", False),
    ("model", "string", False),
    ("policy_version", "int64", False),
    ("status", "string", False),
    ("http_status", "int32", False),
    ("error", "string", True),
    ("token_source", "string", False),
    ("finish_reason", "string", True),
    ("stop_reason", "string", True),
    ("num_prompt_tokens", "int32", False),
    ("num_completion_tokens", "int32", False),
    ("prompt_token_ids", "list<item: int32>", False),
    ("completion_token_ids", "list<item: int32>", False),
    ("behavior_logprobs", "list<item: float>", False),
    ("top_logprob_ids", "list<item: list<item: int32>>", True),
    ("top_logprob_values", "list<item: list<item: float>>", True),
    ("request_messages_json", "string", True),
    ("request_tools_json", "string", True),
    ("request_prompt_json", "string", True),
    ("response_message_json", "string", True),
    ("response_text", "string", True),
    ("sampling_params_json", "string", False),
    ("received_at", "timestamp[us, tz=UTC]", False),
    ("queue_s", "double", False),
    ("ttft_s", "double", True),
    ("total_s", "double", False),
    ("backend", "string", True),
    ("backend_failover_from", "string", True),
    ("policy_version_spans", VERSION_SPANS, True),
    ("policy_switch_unlocated", "bool", True),
    ("tito_context_faithful", "bool", True),
    ("image_spans", IMAGE_SPANS, True),
    ("processor_digest", "string", True),
]
EXPECTED_SAMPLES = [
    ("rollout_id", "string", False),
    ("sample_index", "int32", False),
    ("group_id", "string", True),
    ("task_id", "string", True),
    ("rollout_status", "string", False),
    ("token_source", "string", False),
    ("num_tokens", "int32", False),
    ("num_loss_tokens", "int32", False),
    ("input_ids", "list<item: int32>", False),
    ("loss_mask", "list<item: int8>", False),
    ("behavior_logprobs", "list<item: float>", False),
    ("rewards", REWARDS, False),
    ("reward", "double", True),
    ("num_turns", "int32", False),
    ("turn_spans", TURN_SPANS, False),
    ("turn_statuses", "list<item: string>", False),
    ("policy_versions", "list<item: int64>", False),
    ("min_policy_version", "int64", True),
    ("max_policy_version", "int64", True),
    ("policy_version_spans", VERSION_SPANS, True),
    ("image_spans", IMAGE_SPANS, True),
    ("break_kind", "string", False),
    ("break_position", "int32", True),
    ("break_detail", "string", True),
    ("parent_sample_index", "int32", True),
]
EXPECTED_ROLLOUTS = [
    ("rollout_id", "string", False),
    ("group_id", "string", True),
    ("group_size", "int32", True),
    ("task_id", "string", True),
    ("status", "string", False),
    ("rewards", REWARDS, False),
    ("reward", "double", True),
    ("metadata", "string", True),
    ("num_turns", "int32", False),
    ("num_samples", "int32", False),
    ("num_breaks", "int32", False),
    ("created_at", "timestamp[us, tz=UTC]", False),
    ("sealed_at", "timestamp[us, tz=UTC]", False),
    ("policy_versions", "list<item: int64>", False),
    ("min_policy_version", "int64", True),
    ("max_policy_version", "int64", True),
]
EXPECTED_MEDIA = [
    ("sha256", "string", False),
    ("mime_type", "string", False),
    ("size", "int64", False),
    ("data", "large_binary", False),
    ("rollout_id", "string", False),
    ("stored_at", "timestamp[us, tz=UTC]", False),
]
EXPECTED_QUARANTINE = [
    ("quarantined_at", "timestamp[us, tz=UTC]", False),
    ("table", "string", False),
    ("rollout_id", "string", True),
    ("turn_id", "string", True),
    ("choice_index", "int64", True),
    ("sample_index", "int64", True),
    ("reason", "string", False),
    ("record_format", "string", False),
    ("record", "large_binary", False),
]


def _columns(schema: pa.Schema) -> list[tuple[str, str, bool]]:
    return [(f.name, str(f.type), f.nullable) for f in schema]


def test_schema_version_is_pinned() -> None:
    assert SCHEMA_VERSION == 4


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        (TURNS_SCHEMA, EXPECTED_TURNS),
        (SAMPLES_SCHEMA, EXPECTED_SAMPLES),
        (ROLLOUTS_SCHEMA, EXPECTED_ROLLOUTS),
        (SCHEMAS["media"], EXPECTED_MEDIA),
        (SCHEMAS["quarantine"], EXPECTED_QUARANTINE),
    ],
    ids=["turns", "samples", "rollouts", "media", "quarantine"],
)
def test_columns_are_pinned(schema: pa.Schema, expected: list[tuple[str, str, bool]]) -> None:
    assert _columns(schema) == expected


def test_schemas_carry_version_and_table() -> None:
    for table in ALL_TABLES:
        meta = SCHEMAS[table].metadata
        assert meta[b"turnstile.schema_version"] == b"4"
        assert meta[b"turnstile.table"] == table.encode()


def test_identity_metadata_is_prefixed_and_cannot_override() -> None:
    meta = schema_metadata("samples", {"model": "m", "turnstile.tokenizer": "tok"})
    assert meta == {
        "turnstile.schema_version": "4",
        "turnstile.table": "samples",
        "turnstile.model": "m",
        "turnstile.tokenizer": "tok",
    }
    with pytest.raises(ValueError, match="schema_version"):
        schema_metadata("turns", {"schema_version": "9"})
    table = turns_table([make_turn()], identity={"writer": "w1"})
    assert table.schema.metadata[b"turnstile.writer"] == b"w1"


def test_write_options_skip_token_lists() -> None:
    for table in TABLES:
        nested = {c.name for c in COLUMNS[table] if pa.types.is_nested(c.type)}
        assert not nested & set(dictionary_columns(table))
        assert not nested & set(statistics_columns(table))
    assert "status" in dictionary_columns("turns")
    assert "request_messages_json" not in dictionary_columns("turns")
    assert "min_policy_version" in statistics_columns("samples")


def test_markdown_lists_every_column() -> None:
    doc = schema_markdown()
    for table in ALL_TABLES:
        assert f"### `{table}`" in doc
        for column in COLUMNS[table]:
            assert f"| `{column.name}` |" in doc
    assert "`list<int32>`" in doc and "`list<float32>`" in doc


def test_turns_round_trip_exactly() -> None:
    plain = make_turn("r1", 0, prompt_len=5, completion_len=3, seed=1)
    plain.behavior_logprobs[1] = np.nan
    topk = make_turn(
        "r1",
        1,
        prompt_len=2,
        completion_len=2,
        seed=2,
        top_k=3,
        group_id="g",
        status=TurnStatus.ABORTED,
        token_source=TokenSource.RETOKENIZED,
        finish_reason=None,
        error="cut",
    )
    ragged = make_turn(
        "r1",
        2,
        completion_len=2,
        top_logprob_ids=[[1, 2], [3]],
        top_logprob_values=[[-0.5, -1.5], [-0.25]],
    )
    table = turns_table([plain, topk, ragged])
    assert table.schema.equals(TURNS_SCHEMA)
    assert table.num_rows == 3

    prompt = table.column("prompt_token_ids").combine_chunks()
    assert prompt.type.value_type == pa.int32()
    assert np.array_equal(prompt[0].values.to_numpy(), plain.prompt_token_ids)
    assert table.column("completion_token_ids")[1].as_py() == topk.completion_token_ids.tolist()
    logprobs = table.column("behavior_logprobs")[0].values.to_numpy()
    assert logprobs.dtype == np.float32
    assert np.array_equal(logprobs, plain.behavior_logprobs, equal_nan=True)
    assert math.isnan(logprobs[1])

    rows = table.to_pylist()
    assert rows[0]["top_logprob_ids"] is None and rows[0]["top_logprob_values"] is None
    assert rows[1]["top_logprob_ids"] == topk.top_logprob_ids
    assert rows[1]["top_logprob_values"] == topk.top_logprob_values
    assert rows[2]["top_logprob_ids"] == [[1, 2], [3]]
    assert rows[2]["top_logprob_values"] == [[-0.5, -1.5], [-0.25]]
    assert rows[1]["status"] == "aborted" and rows[1]["token_source"] == "retokenized"
    assert rows[1]["error"] == "cut" and rows[1]["finish_reason"] is None
    assert rows[1]["group_id"] == "g" and rows[0]["group_id"] is None
    assert rows[0]["num_prompt_tokens"] == 5 and rows[0]["num_completion_tokens"] == 3
    assert rows[0]["turn_id"] == plain.turn_id and rows[0]["policy_version"] == 1
    assert rows[0]["queue_s"] == plain.timings.queue_s
    assert rows[0]["ttft_s"] == plain.timings.ttft_s
    micros = table.column("received_at").cast(pa.int64()).to_pylist()
    assert micros[0] == round(plain.timings.received_at * 1e6)


def test_token_dtypes_are_converted_but_not_truncated_from_floats() -> None:
    turn = make_turn(prompt_token_ids=np.array([1, 2, 3], dtype=np.int64))
    assert turns_table([turn]).column("prompt_token_ids")[0].as_py() == [1, 2, 3]
    bad = make_turn(prompt_token_ids=np.array([1.5, 2.0]))
    with pytest.raises(TypeError):
        turns_table([bad])


def test_turn_with_mismatched_logprobs_is_rejected() -> None:
    turn = make_turn(completion_len=3, behavior_logprobs=np.zeros(2, dtype=np.float32))
    with pytest.raises(ValueError, match="logprobs"):
        turns_table([turn])


def test_samples_round_trip_exactly() -> None:
    first = make_sample(
        "r1",
        0,
        length=6,
        seed=3,
        policy_versions=(4, 2),
        rewards=(Reward("correct", 1.0), Reward("len", -0.25, '{"n":6}')),
    )
    second = make_sample(
        "r1",
        1,
        length=3,
        seed=4,
        rewards=(),
        break_position=2,
        break_detail="rewritten",
        parent_sample_index=0,
        turn_spans=[TurnSpan(1, 0, 0, 1, 3), TurnSpan(2, 0, 3, 3, 3)],
        rollout_status=RolloutStatus.ABANDONED,
    )
    table = samples_table([first, second])
    assert table.schema.equals(SAMPLES_SCHEMA)
    ids = table.column("input_ids")[0].values.to_numpy()
    assert ids.dtype == np.int32 and np.array_equal(ids, first.input_ids)
    mask = table.column("loss_mask")[0].values.to_numpy()
    assert mask.dtype == np.int8 and np.array_equal(mask, first.loss_mask)
    logprobs = table.column("behavior_logprobs")[0].values.to_numpy()
    assert np.array_equal(logprobs, first.behavior_logprobs, equal_nan=True)
    assert np.isnan(logprobs[first.loss_mask == 0]).all()

    a, b = table.to_pylist()
    assert a["rewards"] == [
        {"name": "correct", "value": 1.0, "info": None},
        {"name": "len", "value": -0.25, "info": '{"n":6}'},
    ]
    assert a["reward"] == 0.75 and b["reward"] is None and b["rewards"] == []
    assert a["min_policy_version"] == 2 and a["max_policy_version"] == 4
    assert a["policy_versions"] == [4, 2]
    assert a["num_tokens"] == 6 and a["num_loss_tokens"] == 3 and a["num_turns"] == 1
    assert a["break_kind"] == "first" and a["break_position"] is None
    assert b["turn_spans"] == [
        {
            "turn_index": 1,
            "choice_index": 0,
            "prompt_start": 0,
            "completion_start": 1,
            "completion_end": 3,
        },
        {
            "turn_index": 2,
            "choice_index": 0,
            "prompt_start": 3,
            "completion_start": 3,
            "completion_end": 3,
        },
    ]
    assert b["rollout_status"] == "abandoned" and b["parent_sample_index"] == 0
    assert b["break_position"] == 2 and b["break_detail"] == "rewritten"
    assert a["turn_statuses"] == ["ok", "ok"]


def test_sample_with_mismatched_lengths_is_rejected() -> None:
    sample = make_sample(length=4, loss_mask=np.ones(3, dtype=np.int8))
    with pytest.raises(ValueError, match="lengths differ"):
        samples_table([sample])


def test_rollouts_round_trip() -> None:
    rollout = make_rollout(
        "r9", policy_versions=[], rewards=[], metadata_json=None, status=RolloutStatus.INTERRUPTED
    )
    table = rollouts_table([make_rollout("r8"), rollout])
    assert table.schema.equals(ROLLOUTS_SCHEMA)
    full, empty = table.to_pylist()
    assert full["reward"] == 1.5 and full["rewards"][1] == {
        "name": "format",
        "value": 0.5,
        "info": "ok",
    }
    assert full["min_policy_version"] == 1 and full["max_policy_version"] == 2
    assert full["metadata"] == '{"split":"train"}' and full["num_turns"] == 2
    seconds = table.column("sealed_at").cast(pa.int64()).to_pylist()[0] / 1e6
    assert seconds == 1_700_000_012.5
    assert empty["reward"] is None and empty["min_policy_version"] is None
    assert empty["status"] == "interrupted" and empty["metadata"] is None


def test_empty_batches_make_empty_tables() -> None:
    assert turns_table([]).num_rows == 0
    assert samples_table([]).schema.equals(SAMPLES_SCHEMA)
    assert rollouts_table([]).num_rows == 0
