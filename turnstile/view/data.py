"""What `turnstile inspect` and `turnstile view` show, read from published shards.

`OutputData` wraps a `ShardReader` over an output directory (possibly one a running
proxy is writing: every call re-lists the published shards) and returns plain Python
structures: summaries without token lists, one rollout in full with its samples'
tokens, loss masks, logprobs, turn spans, image spans and breaks, and stored images.
`TokenText` decodes token ids to text per token with a local tokenizer, or falls back to
showing the ids.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from turnstile.output.schema import META_TOKENIZER
from turnstile.reader import ShardReader, StoredImage, rewards_dict

# Distinct token ids whose per-token text is kept: a vocabulary is ~150k ids, and a
# viewer session touches far fewer; the cap bounds memory on a long-running `view`.
TOKEN_TEXT_CACHE_SIZE: Final[int] = 200_000

TURN_SUMMARY_COLUMNS: Final[tuple[str, ...]] = (
    "turn_id",
    "rollout_id",
    "turn_index",
    "choice_index",
    "endpoint",
    "model",
    "policy_version",
    "status",
    "http_status",
    "error",
    "token_source",
    "finish_reason",
    "num_prompt_tokens",
    "num_completion_tokens",
    "queue_s",
    "ttft_s",
    "total_s",
)
SAMPLE_SUMMARY_COLUMNS: Final[tuple[str, ...]] = (
    "rollout_id",
    "sample_index",
    "rollout_status",
    "token_source",
    "num_tokens",
    "num_loss_tokens",
    "reward",
    "num_turns",
    "break_kind",
    "break_position",
    "parent_sample_index",
    "min_policy_version",
    "max_policy_version",
)
ROLLOUT_COLUMNS: Final[tuple[str, ...]] = (
    "rollout_id",
    "group_id",
    "task_id",
    "status",
    "rewards",
    "reward",
    "metadata",
    "num_turns",
    "num_samples",
    "num_breaks",
    "created_at",
    "sealed_at",
    "policy_versions",
    "min_policy_version",
    "max_policy_version",
)
_DETAIL_TURN_COLUMNS: Final[tuple[str, ...]] = (
    *TURN_SUMMARY_COLUMNS,
    "stop_reason",
    "request_messages_json",
    "request_tools_json",
    "response_message_json",
    "response_text",
    "sampling_params_json",
)


class TokenText:
    """Per-token text from a local tokenizer directory; `[id]` without one."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._tok: Any = None
        self._special: frozenset[int] = frozenset()
        self._cache: dict[int, str] = {}
        if path is not None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            added = getattr(self._tok, "added_tokens_decoder", {}) or {}
            ids = {int(i) for i in getattr(self._tok, "all_special_ids", [])}
            ids |= {int(i) for i, t in added.items() if getattr(t, "special", False)}
            self._special = frozenset(ids)

    @property
    def available(self) -> bool:
        return self._tok is not None

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    def piece(self, token_id: int) -> str:
        """The text of one token (`[id]` when there is no tokenizer)."""
        if self._tok is None:
            return f"[{token_id}]"
        text = self._cache.get(token_id)
        if text is None:
            text = str(self._tok.decode([token_id], skip_special_tokens=False))
            if len(self._cache) < TOKEN_TEXT_CACHE_SIZE:
                self._cache[token_id] = text
        return text

    def pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.piece(int(i)) for i in ids]

    def text(self, ids: Sequence[int]) -> str:
        """The decoded text of a run of tokens (ids joined when there is no tokenizer)."""
        if self._tok is None:
            return " ".join(f"[{int(i)}]" for i in ids)
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))


def resolve_tokenizer(explicit: Path | None, reader: ShardReader) -> Path | None:
    """`explicit`, else the tokenizer the shards were recorded with if it exists here."""
    if explicit is not None:
        if not explicit.is_dir():
            raise FileNotFoundError(f"tokenizer directory {explicit} does not exist")
        return explicit
    for table in ("samples", "turns"):
        for meta in reversed(reader.metadata(table)):
            recorded = meta.get(META_TOKENIZER) or ""
            if recorded and Path(recorded).is_dir():
                return Path(recorded)
    return None


def _finite(value: Any) -> Any:
    """JSON-safe floats: NaN and infinities become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _rows(table: pa.Table) -> list[dict[str, Any]]:
    return [{k: _finite(v) for k, v in row.items()} for row in table.to_pylist()]


def _json_or_text(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


class OutputData:
    """Read-only access to one output directory's published shards."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.reader = ShardReader(directory)

    def rollouts(self) -> list[dict[str, Any]]:
        rows = _rows(self.reader.rollouts(columns=list(ROLLOUT_COLUMNS)))
        for row in rows:
            row["rewards"] = rewards_dict(row["rewards"])
            row["metadata"] = _json_or_text(row["metadata"])
            for key in ("created_at", "sealed_at"):
                row[key] = row[key].timestamp() if row[key] is not None else None
        rows.sort(key=lambda r: r["created_at"] or 0.0)
        return rows

    def samples(self) -> list[dict[str, Any]]:
        return _rows(self.reader.samples(columns=list(SAMPLE_SUMMARY_COLUMNS)))

    def turns(self) -> list[dict[str, Any]]:
        return _rows(self.reader.turns(columns=list(TURN_SUMMARY_COLUMNS)))

    def media_summary(self) -> dict[str, int]:
        """The `media` table at a glance: distinct images, their bytes, and its shards."""
        table = self.reader.dataset("media").to_table(columns=["sha256", "size"])
        sizes: dict[str, int] = {}
        for sha, size in zip(
            table.column("sha256").to_pylist(), table.column("size").to_pylist(), strict=True
        ):
            sizes[sha] = size  # a hash stored by two writers counts once
        return {
            "images": len(sizes),
            "bytes": sum(sizes.values()),
            "shards": len(self.reader.files("media")),
        }

    def image(self, sha256: str) -> StoredImage | None:
        """One stored image by its hash; None if no published media shard holds it."""
        try:
            return self.reader.images([sha256])[sha256]
        except KeyError:
            return None

    def reward_names(self) -> list[str]:
        names: set[str] = set()
        for row in self.reader.rollouts(columns=["rewards"]).column("rewards").to_pylist():
            names.update(item["name"] for item in row or [])
        return sorted(names)

    def rollout(self, rollout_id: str) -> dict[str, Any] | None:
        """One rollout with its samples (token arrays as lists) and turns; None if unknown."""
        where = pc.field("rollout_id") == rollout_id
        rows = self.reader.dataset("rollouts").to_table(columns=list(ROLLOUT_COLUMNS), filter=where)
        samples = self.reader.dataset("samples").to_table(filter=where)
        turns = self.reader.dataset("turns").to_table(
            columns=list(_DETAIL_TURN_COLUMNS), filter=where
        )
        if rows.num_rows == 0 and samples.num_rows == 0 and turns.num_rows == 0:
            return None
        info: dict[str, Any] = {"rollout_id": rollout_id}
        if rows.num_rows:
            info = _rows(rows.slice(rows.num_rows - 1))[0]
            info["rewards_info"] = {
                r["name"]: r["info"]
                for r in rows.column("rewards")[-1].as_py() or []
                if r.get("info") is not None
            }
            info["rewards"] = rewards_dict(info["rewards"])
            info["metadata"] = _json_or_text(info["metadata"])
            for key in ("created_at", "sealed_at"):
                info[key] = info[key].timestamp() if info[key] is not None else None
        sample_rows = _rows(samples)
        for s in sample_rows:
            s["rewards"] = rewards_dict(s["rewards"])
            s["behavior_logprobs"] = [_finite(x) for x in s["behavior_logprobs"]]
        sample_rows.sort(key=lambda s: s["sample_index"])
        turn_rows = _rows(turns)
        for t in turn_rows:
            for key in (
                "request_messages_json",
                "request_tools_json",
                "response_message_json",
                "sampling_params_json",
            ):
                t[key.removesuffix("_json")] = _json_or_text(t.pop(key))
        turn_rows.sort(key=lambda t: (t["turn_index"], t["choice_index"]))
        info["samples"] = sample_rows
        info["turns"] = turn_rows
        return info
