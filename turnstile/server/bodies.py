"""The rollout API's request bodies, checked where they enter, before any value can reach
a column: strict, finite numbers; policy versions within int64; text that is valid UTF-8
(a lone surrogate, which JSON can spell as ``"\\ud800"``, cannot be written to Parquet or the
journal) and JSON no deeper than orjson writes. A body that fails is a 422 in the OpenAI
error shape (see ``turnstile.server.routes.api``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from turnstile.limits import MAX_GROUP_SIZE, MAX_JSON_DEPTH, MAX_POLICY_VERSION, MIN_POLICY_VERSION

__all__ = [
    "CreateRollout",
    "FinishRollout",
    "PolicyVersion",
    "PostRewards",
    "first_invalid_text",
]

# A reward is a finite number given as a JSON number: not `true`, not "1.5", not NaN.
RewardValue = Annotated[float, Field(strict=True, allow_inf_nan=False)]


def first_invalid_text(value: Any, path: str = "", depth: int = 0) -> str | None:
    """Why ``value`` cannot be recorded as JSON text, naming where: a string (or key) that
    is not valid UTF-8, or nesting deeper than orjson writes; None when it can."""
    if depth > MAX_JSON_DEPTH:
        return f"{path or '.'}: nested deeper than {MAX_JSON_DEPTH} levels"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{path or '.'}: text must be valid UTF-8 (no lone surrogates)"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if isinstance(key, str) and key.isprintable() else path
            found = first_invalid_text(key, where, depth + 1)
            if found is None:
                found = first_invalid_text(item, where, depth + 1)
            if found is not None:
                return found
        return None
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = first_invalid_text(item, f"{path}[{index}]", depth + 1)
            if found is not None:
                return found
    return None


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _valid_text(self) -> _Body:
        found = first_invalid_text(self.model_dump())
        if found is not None:
            raise ValueError(found.lstrip("."))
        return self


class CreateRollout(_Body):
    rollout_id: str | None = Field(default=None, description="choose the id (default: random)")
    group_id: str | None = Field(default=None, description="GRPO group this rollout belongs to")
    group_size: int | None = Field(
        default=None,
        strict=True,
        ge=1,
        le=MAX_GROUP_SIZE,
        description="rollouts in the group: it is published once that many are sealed",
    )
    task_id: str | None = None
    metadata: dict[str, Any] | None = None


class PostRewards(_Body):
    rewards: dict[str, RewardValue] = Field(
        default_factory=dict, description="name -> value (a finite JSON number)"
    )
    info: dict[str, Any] = Field(
        default_factory=dict, description="name -> verifier information (text or JSON)"
    )


class FinishRollout(PostRewards):
    pass


class Pause(_Body):
    mode: Literal["pause", "abort"] = Field(
        default="pause",
        description="pause: calls in flight finish; abort: they are cut (recorded aborted)",
    )


class Resume(_Body):
    policy_version: int | None = Field(
        default=None,
        strict=True,
        ge=MIN_POLICY_VERSION,
        le=MAX_POLICY_VERSION,
        description="the version of the weights just pushed (default: unchanged)",
    )


class PolicyVersion(_Body):
    policy_version: int = Field(strict=True, ge=MIN_POLICY_VERSION, le=MAX_POLICY_VERSION)
    mode: Literal["keep", "pause", "abort"] = Field(
        default="keep",
        description="keep: calls in flight go on, their tokens from now on carry the new "
        "version; pause: new calls wait, calls in flight finish, then the switch; abort: "
        "calls in flight are cut (recorded aborted), then the switch",
    )
