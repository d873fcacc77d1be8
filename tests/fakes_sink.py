"""An in-memory `Sink` and record factories for unit tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from turnstile.output.schema import rollouts_table, samples_table, turns_table
from turnstile.output.shards import Sink, SinkError, SinkProgress
from turnstile.records import (
    BreakKind,
    MediaRecord,
    QuarantineRecord,
    Reward,
    RolloutRecord,
    RolloutStatus,
    SampleRecord,
    Timings,
    TokenSource,
    TurnRecord,
    TurnSpan,
    TurnStatus,
)


@dataclass
class InMemorySink:
    """Keeps records in lists: `pending_*` until `flush`/`maybe_roll`, then `turns` etc.

    Set `fail_with` to make the next write, roll or flush raise that error (once).
    """

    turns: list[TurnRecord] = field(default_factory=list)
    samples: list[SampleRecord] = field(default_factory=list)
    rollouts: list[RolloutRecord] = field(default_factory=list)
    quarantine: list[QuarantineRecord] = field(default_factory=list)
    media: list[MediaRecord] = field(default_factory=list)
    pending_turns: list[TurnRecord] = field(default_factory=list)
    pending_samples: list[SampleRecord] = field(default_factory=list)
    pending_rollouts: list[RolloutRecord] = field(default_factory=list)
    flushes: int = 0
    closed: bool = False
    fail_with: SinkError | None = None

    def _check(self) -> None:
        if self.closed:
            raise SinkError("sink is closed")
        if self.fail_with is not None:
            error, self.fail_with = self.fail_with, None
            raise error

    def write_turns(self, records: Sequence[TurnRecord]) -> None:
        self._check()
        self.pending_turns.extend(records)

    def write_samples(self, records: Sequence[SampleRecord]) -> None:
        self._check()
        self.pending_samples.extend(records)

    def write_rollouts(self, records: Sequence[RolloutRecord]) -> None:
        self._check()
        self.pending_rollouts.extend(records)

    def write_media(self, records: Sequence[MediaRecord]) -> None:
        self._check()
        stored = {m.sha256 for m in self.media}
        self.media.extend(r for r in records if r.sha256 not in stored)

    def write_quarantine(self, records: Sequence[QuarantineRecord]) -> None:
        self._check()
        self.quarantine.extend(records)

    def maybe_roll(self, now: float | None = None) -> None:
        self.flush()

    def flush(self) -> None:
        self._check()
        self.turns += self.pending_turns
        self.samples += self.pending_samples
        self.rollouts += self.pending_rollouts
        self.pending_turns, self.pending_samples, self.pending_rollouts = [], [], []
        self.flushes += 1

    def close(self) -> None:
        if not self.closed:
            self.flush()
            self.closed = True

    def progress(self) -> SinkProgress:
        settled = {
            "turns": len(self.turns),
            "samples": len(self.samples),
            "rollouts": len(self.rollouts),
        }
        accepted = {
            "turns": settled["turns"] + len(self.pending_turns),
            "samples": settled["samples"] + len(self.pending_samples),
            "rollouts": settled["rollouts"] + len(self.pending_rollouts),
        }
        return SinkProgress(accepted, settled)

    def tables(self) -> dict[str, pa.Table]:
        """The published records as Arrow tables (checks they convert)."""
        return {
            "turns": turns_table(self.turns),
            "samples": samples_table(self.samples),
            "rollouts": rollouts_table(self.rollouts),
        }


def _conforms(sink: InMemorySink) -> Sink:
    return sink


def make_turn(
    rollout_id: str = "r0",
    turn_index: int = 0,
    *,
    prompt_len: int = 8,
    completion_len: int = 4,
    seed: int = 0,
    top_k: int | None = None,
    **overrides: Any,
) -> TurnRecord:
    """A plausible turn with random token ids and logprobs."""
    rng = np.random.default_rng(seed)
    top_ids = top_values = None
    if top_k is not None:
        top_ids = rng.integers(0, 150_000, (completion_len, top_k)).tolist()
        top_values = (-rng.random((completion_len, top_k))).astype(np.float32).tolist()
    fields: dict[str, Any] = {
        "turn_id": f"{rollout_id}-t{turn_index}",
        "rollout_id": rollout_id,
        "turn_index": turn_index,
        "choice_index": 0,
        "endpoint": "chat.completions",
        "model": "test-model",
        "policy_version": 1,
        "status": TurnStatus.OK,
        "token_source": TokenSource.BACKEND,
        "prompt_token_ids": rng.integers(0, 150_000, prompt_len, dtype=np.int32),
        "completion_token_ids": rng.integers(0, 150_000, completion_len, dtype=np.int32),
        "behavior_logprobs": (-rng.random(completion_len)).astype(np.float32),
        "finish_reason": "stop",
        "stop_reason": None,
        "request_messages_json": '[{"role":"user","content":"hi"}]',
        "request_tools_json": None,
        "request_prompt_json": None,
        "response_message_json": '{"role":"assistant","content":"hello"}',
        "response_text": None,
        "sampling_params_json": '{"temperature":1.0}',
        "timings": Timings(received_at=1_700_000_000.25, queue_s=0.001, ttft_s=0.05, total_s=0.5),
        "http_status": 200,
        "top_logprob_ids": top_ids,
        "top_logprob_values": top_values,
    }
    fields.update(overrides)
    return TurnRecord(**fields)


def make_sample(
    rollout_id: str = "r0",
    sample_index: int = 0,
    *,
    length: int = 16,
    seed: int = 0,
    policy_versions: Sequence[int] = (1,),
    rewards: Sequence[Reward] = (Reward("correct", 1.0),),
    **overrides: Any,
) -> SampleRecord:
    """A plausible sample: the second half of `input_ids` is sampled."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(length, dtype=np.int8)
    mask[length // 2 :] = 1
    logprobs = np.where(mask == 1, -rng.random(length), np.nan).astype(np.float32)
    fields: dict[str, Any] = {
        "rollout_id": rollout_id,
        "sample_index": sample_index,
        "group_id": "g0",
        "task_id": "task-0",
        "input_ids": rng.integers(0, 150_000, length, dtype=np.int32),
        "loss_mask": mask,
        "behavior_logprobs": logprobs,
        "turn_spans": [TurnSpan(0, 0, 0, length // 2, length)],
        "rewards": list(rewards),
        "policy_versions": list(policy_versions),
        "token_source": TokenSource.BACKEND,
        "rollout_status": RolloutStatus.FINISHED,
        "break_kind": BreakKind.FIRST,
        "break_position": None,
        "break_detail": None,
        "parent_sample_index": None,
        "turn_statuses": ["ok"] * len(policy_versions),
    }
    fields.update(overrides)
    return SampleRecord(**fields)


def make_rollout(rollout_id: str = "r0", **overrides: Any) -> RolloutRecord:
    """A plausible sealed rollout summary."""
    fields: dict[str, Any] = {
        "rollout_id": rollout_id,
        "group_id": "g0",
        "task_id": "task-0",
        "metadata_json": '{"split":"train"}',
        "rewards": [Reward("correct", 1.0), Reward("format", 0.5, "ok")],
        "status": RolloutStatus.FINISHED,
        "num_turns": 2,
        "num_samples": 1,
        "num_breaks": 0,
        "created_at": 1_700_000_000.0,
        "sealed_at": 1_700_000_012.5,
        "policy_versions": [1, 2],
    }
    fields.update(overrides)
    return RolloutRecord(**fields)
