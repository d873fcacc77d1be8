"""The TITO-exact question: can the delta be found, so every sample equals the token stream?

TITO never re-renders history: turn k+1's prompt is prompt k + the sampled completion
(ending with the end-of-turn token the model sampled) + the delta, the rendering of the
new messages cut after the previous assistant turn's end-of-turn marker
(``turnstile.tito.render.TemplateRenderer.delta``). That is exact whenever the delta can
be found; whether the accumulated context equals a re-render is a separate question
(deployment faithfulness, ``turnstile.tito.templates.audit``).

``check_exact`` runs the engine's own delta code over the audit battery: each assistant
turn is sampled as the template renders it, and each later turn's delta must be found
(the assistant turn ends with a token the model stops on, the new rendering has as many
end-of-turn markers as the history) and must hold the new user messages (else the turn
boundary is ambiguous: the cut fell somewhere else).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from turnstile.tito.templates.battery import ASSISTANT_KINDS, KIND_USER, Conversation

__all__ = ["check_exact"]


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
            missing = [
                m.body["content"]
                for m in new
                if m.kind == KIND_USER and m.body["content"] not in delta.text
            ]
            if missing:
                return found, (
                    f"'{conv.name}': the turn boundary is ambiguous: the delta after the "
                    f"{conv.messages[previous].kind} turn ({delta.text[:60]!r}...) lacks the "
                    f"new user message {missing[0]!r}"
                )
            found += 1
        if point == len(bodies):
            break
        try:
            prompt = renderer.render(bodies[:point], tools, None, True)
            whole = renderer.render(bodies[: point + 1], tools, None, False)
        except RenderError:
            return found, None
        if renderer.end_of_turn(whole, renderer.turn_start(prompt, whole)) is None:
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
