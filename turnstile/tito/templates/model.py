"""The template audit's result types and their JSON form.

``AuditReport`` is what ``audit_template`` returns and ``turnstile check-template --json``
writes (``to_dict``; schema ``JSON_SCHEMA``): the two answers (``tito_exact``: TITO finds
every delta, so every sample equals the token stream; ``deployment_faithful``: the context
TITO accumulates equals what the template renders for the same messages), per message kind
whether its rendering is prefix-preserving and where it breaks, the end-of-turn markers,
and known fixes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "JSON_SCHEMA",
    "STATUS_FAIL",
    "STATUS_IGNORED",
    "STATUS_PASS",
    "STATUS_UNSUPPORTED",
    "STATUS_UNTESTED",
    "AuditError",
    "AuditReport",
    "Break",
    "EndOfTurn",
    "Fix",
    "KindResult",
]

JSON_SCHEMA = "turnstile.template-audit/2"

# A kind's status. "ignored": its renderings are prefix-preserving but the template drops
# the reasoning it carries in every turn (it reads another field, or none); a re-render then
# lacks what the model sampled, but no rendering changes as the conversation grows.
STATUS_PASS = "pass"
STATUS_FAIL = "fail"
STATUS_IGNORED = "ignored"
STATUS_UNSUPPORTED = "unsupported"  # every conversation with it failed to render
STATUS_UNTESTED = "untested"  # never rendered as history

LEVEL_TEXT = "text"
LEVEL_TOKENS = "tokens"
LEVEL_CONTENT = "content"


class AuditError(ValueError):
    """The template cannot be audited: there is none, or it renders no conversation."""


@dataclass(frozen=True)
class Break:
    """Where a later rendering stops extending an earlier one.

    ``earlier``/``later`` show the two renderings around ``char_index`` (the first
    differing character, in the earlier rendering); ``earlier_tokens``/``later_tokens``
    show decoded tokens around ``token_index``. ``changed`` is the kind of the message
    whose rendering changed (``changed_index`` its position), ``trigger`` the kinds of
    the messages whose appending revealed it.
    """

    conversation: str
    level: str
    trigger: list[str]
    changed: str
    changed_index: int | None
    description: str
    char_index: int | None = None
    earlier: str = ""
    later: str = ""
    token_index: int | None = None
    earlier_tokens: list[str] = field(default_factory=list)
    later_tokens: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class EndOfTurn:
    """How an assistant turn ends when rendered: its last non-whitespace token."""

    kind: str
    marker: str | None  # the token's text, None when it is not an added/special token
    token_id: int | None
    is_eos: bool
    is_stop_token: bool
    trailing: str  # what the template renders after it (separator before the next turn)


@dataclass
class KindResult:
    kind: str
    status: str = STATUS_UNTESTED
    prefix_preserving: bool | None = None
    token_prefix_preserving: bool | None = None
    renders_reasoning: bool | None = None  # None: the kind carries no reasoning
    checks: int = 0
    break_: Break | None = None
    end_of_turn: EndOfTurn | None = None
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["break"] = out.pop("break_")
        return out


@dataclass(frozen=True)
class Fix:
    """A known way around a failure. ``chat_template_kwargs`` and ``template`` (a patched
    template text), when set, were re-audited: ``verified`` says whether the template then
    passes."""

    description: str
    chat_template_kwargs: dict[str, Any] | None = None
    verified: bool | None = None
    template: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: the patched template's text is left out (its presence is not)."""
        return {
            "description": self.description,
            "chat_template_kwargs": self.chat_template_kwargs,
            "verified": self.verified,
            "patched_template": self.template is not None,
        }


@dataclass
class AuditReport:
    """The audit's answers. ``exact_reasons``: why TITO cannot find the delta (empty:
    ``tito_exact``, the gate); ``differences``: where the accumulated context differs from a
    re-render, with the first difference and the kinds concerned (empty:
    ``deployment_faithful``, a warning unless ``--tito-history template``)."""

    tokenizer: str
    template_source: str
    template_sha256: str
    chat_template_kwargs: dict[str, Any]
    vllm_messages: bool
    exact_reasons: list[str]
    differences: list[str]
    warnings: list[str]
    fixes: list[Fix]
    kinds: list[KindResult]
    stop_token_ids: list[int]
    generation_prompt: str
    conversations: dict[str, str]  # name -> "ok" or why it could not be rendered

    @property
    def tito_exact(self) -> bool:
        """TITO finds every delta: every sample equals the token stream."""
        return not self.exact_reasons

    @property
    def deployment_faithful(self) -> bool:
        """The accumulated context equals what the template renders for the messages."""
        return not self.differences

    @property
    def tito_safe(self) -> bool:
        """Both: exact, and faithful to the template's own rendering."""
        return self.tito_exact and self.deployment_faithful

    @property
    def reasons(self) -> list[str]:
        """Every reason the template is not TITO-safe (exactness first)."""
        return [*self.exact_reasons, *self.differences]

    def kind(self, name: str) -> KindResult:
        for result in self.kinds:
            if result.kind == name:
                return result
        raise KeyError(name)

    def failing_kinds(self) -> list[str]:
        return [result.kind for result in self.kinds if result.status == STATUS_FAIL]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": JSON_SCHEMA,
            "tokenizer": self.tokenizer,
            "template_source": self.template_source,
            "template_sha256": self.template_sha256,
            "chat_template_kwargs": self.chat_template_kwargs,
            "vllm_messages": self.vllm_messages,
            "tito_exact": self.tito_exact,
            "deployment_faithful": self.deployment_faithful,
            "tito_safe": self.tito_safe,
            "exact_reasons": self.exact_reasons,
            "differences": self.differences,
            "reasons": self.reasons,
            "warnings": self.warnings,
            "fixes": [fix.to_dict() for fix in self.fixes],
            "kinds": {result.kind: result.to_dict() for result in self.kinds},
            "stop_token_ids": self.stop_token_ids,
            "generation_prompt": self.generation_prompt,
            "conversations": self.conversations,
        }
