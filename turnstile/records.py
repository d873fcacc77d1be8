"""The in-memory records that flow from the proxy to the shards.

A `TurnRecord` is one backend call and one choice, exactly as the backend consumed and
sampled it. A `SampleRecord` is a training sequence stitched from consecutive turns of a
rollout. A `RolloutRecord` is the rollout's summary row. These are plain dataclasses so
that the proxy, the stitcher and the shard writer share one vocabulary; the Parquet
schema (`turnstile.output.schema`) maps them onto columns.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

Int32Array = npt.NDArray[np.int32]
Float32Array = npt.NDArray[np.float32]
Int8Array = npt.NDArray[np.int8]


class TurnStatus(enum.StrEnum):
    """How a backend call ended."""

    OK = "ok"
    ABORTED = "aborted"  # the stream was cut (backend died, client left, shutdown)
    ERROR = "error"  # the backend refused or could not be reached


class TokenSource(enum.StrEnum):
    """Where a turn's token IDs came from."""

    BACKEND = "backend"  # the backend returned the IDs it consumed and sampled
    RETOKENIZED = "retokenized"  # Turnstile tokenized text itself: not exact
    NONE = "none"  # no IDs at all (error before any token, or no tokenizer)


class RolloutStatus(enum.StrEnum):
    """Life cycle of a rollout."""

    OPEN = "open"
    FINISHED = "finished"  # sealed by POST /rollouts/{id}/finish
    ABANDONED = "abandoned"  # sealed by the idle timeout
    INTERRUPTED = "interrupted"  # sealed at shutdown while still open


class BreakKind(enum.StrEnum):
    """Why a new training sample starts inside a rollout."""

    FIRST = "first"  # the rollout's first sample: no break
    HISTORY_REWRITTEN = "history_rewritten"  # messages do not extend the previous turn's
    RERENDER = "rerender"  # same messages, but the re-rendered text differs
    TOKENIZATION = "tokenization"  # same text, different token IDs
    TRUNCATED = "truncated"  # the new prompt is shorter than the previous context
    TOKEN_SOURCE = "token_source"  # a side has no exact IDs (retokenized or missing)
    BRANCH = "branch"  # a sibling choice (n > 1) or a turn that continues no chain
    IMAGES = "images"  # same tokens, but other images (or unlocated ones) at the placeholders
    UNCLASSIFIED = "unclassified"  # a token mismatch with no tokenizer to classify it


@dataclass(frozen=True, slots=True)
class ImageRef:
    """One image of a call, in the order the request gives them, and where its
    placeholder tokens sit: in a turn's `prompt_token_ids`, or in a sample's `input_ids`.

    `sha256` names the bytes in the `media` table (None for a remote image recorded by URL
    only); `url` is the remote URL it came from (None for inline data); `start` and
    `length` are None where the placeholders could not be located (no image token id
    configured, or the prompt's placeholder runs do not match the request's images).
    """

    sha256: str | None
    url: str | None
    start: int | None
    length: int | None


@dataclass(frozen=True, slots=True)
class MediaBlob:
    """The bytes of one image, carried with the first turn of a rollout that used it."""

    sha256: str
    mime_type: str
    data: bytes


@dataclass(frozen=True, slots=True)
class MediaRecord:
    """One row of the `media` table: the bytes of one image, stored once per hash."""

    sha256: str
    mime_type: str
    data: bytes
    rollout_id: str  # the rollout that first brought it
    stored_at: float  # unix time


@dataclass(frozen=True, slots=True)
class Timings:
    """Seconds measured by the proxy for one backend call."""

    received_at: float  # unix time the request reached Turnstile
    queue_s: float  # from receipt until the upstream request was sent
    ttft_s: float | None  # from receipt until the first completion byte (None: none)
    total_s: float  # from receipt until the turn ended


@dataclass(slots=True)
class TurnRecord:
    """One backend call and one of its choices, as recorded."""

    turn_id: str  # unique per backend call; choices of one call share it
    rollout_id: str
    turn_index: int  # order of the call within the rollout
    choice_index: int
    endpoint: str  # "chat.completions" or "completions"
    model: str
    policy_version: int
    status: TurnStatus
    token_source: TokenSource
    prompt_token_ids: Int32Array
    completion_token_ids: Int32Array
    behavior_logprobs: Float32Array  # one per completion token (NaN where unknown)
    finish_reason: str | None
    stop_reason: str | None
    request_messages_json: str | None  # chat: the request's messages
    request_tools_json: str | None
    request_prompt_json: str | None  # completions: the request's prompt
    response_message_json: str | None  # chat: content, reasoning, tool_calls
    response_text: str | None  # completions: the sampled text
    sampling_params_json: str
    timings: Timings
    http_status: int
    error: str | None = None
    group_id: str | None = None
    # top-k alternatives per completion token, when configured
    top_logprob_ids: list[list[int]] | None = None
    top_logprob_values: list[list[float]] | None = None
    # with several backends (turnstile.backends.pool): the one that served the call, and the dead
    # one the rollout was moved away from when this call failed over
    backend: str | None = None
    backend_failover_from: str | None = None
    # (first completion token, policy version) of each run of tokens sampled under one
    # version, in order; empty means all of it under `policy_version`
    policy_version_spans: list[tuple[int, int]] = field(default_factory=list)
    # a whole (non-streamed) call that a policy switch fell inside: where is not known
    policy_switch_unlocated: bool = False
    # TITO mode: whether the prompt equals the chat template's rendering of the request's
    # messages (deployment-faithful); None in record mode
    tito_context_faithful: bool | None = None
    # the request's images in order, with their placeholder spans in `prompt_token_ids`
    images: list[ImageRef] = field(default_factory=list)
    # the bytes of images this rollout had not sent before (journaled with the turn and
    # written once per hash to the `media` table); not a column of `turns`
    media: list[MediaBlob] = field(default_factory=list)
    # digest of the vision-language processor configuration the images were processed with
    processor_digest: str | None = None

    def version_spans(self) -> list[tuple[int, int]]:
        """`policy_version_spans`, or the one span of a turn sampled under one version."""
        return self.policy_version_spans or [(0, self.policy_version)]


@dataclass(frozen=True, slots=True)
class TurnSpan:
    """Where one turn sits inside a stitched sample's `input_ids`."""

    turn_index: int
    choice_index: int
    prompt_start: int  # first token of this turn's new prompt tokens
    completion_start: int
    completion_end: int  # exclusive


@dataclass(frozen=True, slots=True)
class Reward:
    """One named reward, with optional verifier information (text or JSON text)."""

    name: str
    value: float
    info: str | None = None


@dataclass(slots=True)
class SampleRecord:
    """A training sequence stitched from consecutive turns of one rollout."""

    rollout_id: str
    sample_index: int
    group_id: str | None
    task_id: str | None
    input_ids: Int32Array
    loss_mask: Int8Array  # 1 exactly on sampled tokens
    behavior_logprobs: Float32Array  # aligned with input_ids, NaN where loss_mask == 0
    turn_spans: list[TurnSpan]
    rewards: list[Reward]
    policy_versions: list[int]  # one per turn in the sample
    token_source: TokenSource
    rollout_status: RolloutStatus
    break_kind: BreakKind  # why this sample starts (FIRST for the first)
    break_position: int | None  # index of the first mismatching token, if any
    break_detail: str | None
    parent_sample_index: int | None  # the sample this one breaks away from
    turn_statuses: list[str] = field(default_factory=list)
    # (first index in input_ids, policy version) of each run of sampled tokens under one
    # version, in order (the turns' `policy_version_spans` placed in the sample)
    policy_version_spans: list[tuple[int, int]] = field(default_factory=list)
    # the images of the stitched turns, each once, with their spans in `input_ids`
    images: list[ImageRef] = field(default_factory=list)


@dataclass(slots=True)
class RolloutRecord:
    """One row per sealed rollout."""

    rollout_id: str
    group_id: str | None
    task_id: str | None
    metadata_json: str | None
    rewards: list[Reward]
    status: RolloutStatus
    num_turns: int
    num_samples: int
    num_breaks: int
    created_at: float
    sealed_at: float
    policy_versions: list[int]
    group_size: int | None = None  # declared when the rollout was created


@dataclass(frozen=True, slots=True)
class QuarantineRecord:
    """A row that could not be written to its table, kept with the reason.

    Built by `turnstile.output.quarantine.quarantine`, which makes every field safe to
    write (valid UTF-8 text, keys within int64), so a quarantine row itself never fails.
    """

    table: str  # the table the row was meant for
    reason: str
    record_format: str  # "journal" (a turn's journal payload) or "json"
    record: bytes
    quarantined_at: float
    rollout_id: str | None = None
    turn_id: str | None = None
    choice_index: int | None = None
    sample_index: int | None = None
