"""The TITO-exact question: can the delta be found, so every sample equals the token stream?

TITO never re-renders history: turn k+1's prompt is prompt k + the sampled completion
(ending with the end-of-turn token the model sampled) + the delta, the rendering of the
new messages cut after the previous assistant turn's end-of-turn marker
(``turnstile.tito.render.TemplateRenderer.delta``). That is exact whenever the delta can
be found; whether the accumulated context equals a re-render is a separate question
(deployment faithfulness, ``turnstile.tito.templates.audit``).

``check_exact`` runs the engine's own delta code over the audit battery: each assistant
turn is sampled as the template renders it, and each later turn's delta must be found
(the assistant turn ends with a token the model stops on, possibly the next message's
header; the new rendering has as many end-of-turn markers as the history) and must hold
the new user and tool messages and not the sampled turn's own text (else the turn boundary
is ambiguous: the cut fell somewhere else).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from turnstile.tito.templates.battery import (
    ASSISTANT_KINDS,
    KIND_TOOL,
    KIND_USER,
    Conversation,
    Message,
)

__all__ = ["check_exact"]

# A word of a new message's text that any rendering of it keeps (a template may escape
# JSON quotes or non-ASCII text, not words).
_WORD = re.compile(r"[A-Za-z_]{4,}")


def _sign(message: Message) -> str:
    """What the delta must hold of a new user or tool message: its text (user), a word
    of it (tool: templates may serialise the content)."""
    content = message.body.get("content")
    if not isinstance(content, str) or message.kind not in (KIND_USER, KIND_TOOL):
        return ""
    if message.kind == KIND_USER:
        return content
    word = _WORD.search(content)
    return word.group(0) if word else ""


def _simulate(
    renderer: Any, conv: Conversation, tools: list[dict[str, Any]] | None
) -> tuple[int, str | None]:
    """Deltas found in ``conv`` and the reason TITO cannot be exact, if any. A
    conversation the template cannot render at all is skipped (0 deltas, no reason)."""
    from turnstile.tito.render import RenderError

    bodies = conv.bodies()
    assistants = [i for i, m in enumerate(conv.messages) if m.kind in ASSISTANT_KINDS]
    found = 0
    previous: int | None = None
    for point in [*assistants, len(bodies)]:
        if previous is not None:
            new = conv.messages[previous + 1 : point]
            if not new:
                break
            try:
                delta = renderer.delta(bodies[: previous + 1], bodies[:point], tools, None)
            except RenderError as exc:
                if "cannot render" in str(exc):
                    return found, None
                return found, (
                    f"'{conv.name}': no delta after the {conv.messages[previous].kind} turn: {exc}"
                )
            sampled = conv.messages[previous]
            full = renderer.render(bodies[:point], tools, None, True)
            # What the template renders of the new messages must be in the delta (what
            # it does not render at all is no matter of exactness).
            missing = [
                _sign(m)
                for m in new
                if _sign(m) and _sign(m) in full and _sign(m) not in delta.text
            ]
            own = (sampled.body.get("content") or "").split("</think>")[-1].strip()
            if missing or (own and own in delta.text):
                what = f"lacks the new {missing[0]!r}" if missing else f"repeats the turn's {own!r}"
                return found, (
                    f"'{conv.name}': the turn boundary is ambiguous: the delta after the "
                    f"{sampled.kind} turn ({delta.text[:60]!r}...) {what}, so its end is not "
                    "where the template ends the turn"
                )
            found += 1
        if point == len(bodies):
            break
        try:
            prompt = renderer.render(bodies[:point], tools, None, True)
            whole = renderer.render(bodies[: point + 1], tools, None, False)
        except RenderError:
            return found, None
        start = renderer.turn_start(prompt, whole)
        end = renderer.end_of_turn(whole, start)
        message = conv.messages[point]
        answer = (message.body.get("content") or "").split("</think>")[-1].strip()
        if end is not None and message.reasoning and answer:
            # A stop token between the turn's reasoning and its answer: the model stops
            # after reasoning (the turn is several messages, each closed by a stop token).
            thought = whole.rfind(message.reasoning)
            said = whole.rfind(answer)
            first = renderer.end_of_turn(whole, max(start, thought)) if thought >= 0 else None
            split = first is not None and thought >= start and first[0] <= said
        else:
            split = False
        if split:
            return found, (
                f"'{conv.name}': the {message.kind} turn has a token the model stops on "
                "between its reasoning and its answer (it would stop after reasoning)"
            )
        if end is None and point + 1 == len(bodies):
            return found, (
                f"'{conv.name}': the {conv.messages[point].kind} turn does not end with a "
                f"token the model stops on (stop ids {sorted(renderer.stops)})"
            )
        previous = point
    return found, None


def check_exact(
    tokenizer: Any,
    template: str,
    kwargs: Mapping[str, Any],
    stop_token_ids: Sequence[int],
    conversations: Sequence[Conversation],
) -> tuple[bool, list[str]]:
    """Whether TITO finds every delta of ``conversations`` with this template, and why
    not (one reason per conversation that fails)."""
    from turnstile.tito.render import TemplateRenderer

    renderer = TemplateRenderer(tokenizer, template, kwargs, stop_token_ids)
    reasons: list[str] = []
    deltas = 0
    for conv in conversations:
        found, reason = _simulate(renderer, conv, conv.tools)
        deltas += found
        if reason is not None:
            reasons.append(reason)
    if not reasons and deltas == 0:
        reasons.append("no conversation of the audit reached a second turn, so no delta was found")
    return not reasons, reasons
