"""The template audit: is a chat template safe for token-in-token-out (TITO) stitching?

Two questions, answered separately. *TITO-exact* (the gate): can TITO find each turn's
delta, so that every sample equals the token stream (``turnstile.tito.templates.exact``)?
*Deployment-faithful* (a warning unless the history must be the template's): does the
context TITO accumulates equal what re-rendering the conversation gives? The rest of this
module answers the second:

TITO builds turn k+1's prompt as turn k's prompt + the sampled completion (ending with the
end-of-turn token the model sampled) + the rendering of the new messages. That equals what
re-rendering the whole conversation gives only when every rendering extends the previous
one at the points where TITO joins pieces:

* assistant step: ``render(messages[:j], add_generation_prompt=True)`` must be a prefix of
  ``render(messages[:j+1])``, and the continuation must hold what the model sampled
  (content, reasoning, tool calls) and end with a token the model stops on;
* delta step: that rendering, up to the assistant's end-of-turn token, must be a prefix of
  the next prompt (``render(messages[:j'], add_generation_prompt=True)`` at the next
  assistant message, or the final prompt).

Both are checked on text and on token IDs, over the conversations of
``turnstile.tito.templates.battery``. A break is attributed to the message whose rendering
changed (found from the renderings of every prefix) and reported with its context.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from turnstile.tito.templates.battery import (
    ASSISTANT_KINDS,
    KIND_ORDER,
    REASONING_KINDS,
    Conversation,
    Message,
    battery,
)
from turnstile.tito.templates.exact import check_exact
from turnstile.tito.templates.fixes import known_fixes
from turnstile.tito.templates.model import (
    LEVEL_CONTENT,
    LEVEL_TEXT,
    LEVEL_TOKENS,
    STATUS_FAIL,
    STATUS_IGNORED,
    STATUS_PASS,
    STATUS_UNSUPPORTED,
    STATUS_UNTESTED,
    AuditError,
    AuditReport,
    Break,
    EndOfTurn,
    KindResult,
)
from turnstile.tito.templates.render import Renderer, as_vllm_renders, hf_tokenizer, stop_ids

__all__ = ["as_vllm_renders", "audit_template"]

# Characters of context shown on each side of a text break.
CONTEXT_CHARS = 30
# Tokens of context shown on each side of a token break.
CONTEXT_TOKENS = 3
# Template features that make renderings depend on the clock (HF's jinja global).
_CLOCK_MARKERS = ("strftime_now",)


def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    limit = min(len(a), len(b))
    for index in range(limit):
        if a[index] != b[index]:
            return index
    return limit


def _context(text: str, at: int) -> str:
    start = max(0, at - CONTEXT_CHARS)
    return f"{text[start:at]!r} | {text[at : at + CONTEXT_CHARS]!r}"


class _Collector:
    """Per-kind results as the checks run."""

    def __init__(self) -> None:
        self.results = {kind: KindResult(kind) for kind in KIND_ORDER}
        self.reasoning_seen: dict[str, list[bool]] = {}

    def checked(self, kinds: Sequence[str]) -> None:
        for kind in set(kinds):
            self.results[kind].checks += 1

    def broke(self, found: Break) -> None:
        result = self.results[found.changed]
        if found.level == LEVEL_TOKENS:
            result.token_prefix_preserving = False
        elif found.level == LEVEL_TEXT:
            result.prefix_preserving = False
            result.token_prefix_preserving = False
        if result.break_ is None or (
            result.break_.level != LEVEL_TEXT and found.level == LEVEL_TEXT
        ):
            result.break_ = found


def _changed(earlier: str, at: int, prefixes: list[str | None], gen_from: int | None) -> int | None:
    """The index of the message whose rendering contains position ``at`` of ``earlier``;
    ``prefixes[i]`` renders the first ``i`` messages. None: the generation prompt (which
    starts at ``gen_from``)."""
    if gen_from is not None and at >= gen_from:
        return None
    best: int | None = None
    for index, prefix in enumerate(prefixes):
        if prefix is not None and len(prefix) <= at and earlier.startswith(prefix):
            best = index
    return best


def _describe(message: Message | None, earlier_span: str, later: str, at_text: str) -> str:
    if message is None:
        return "the generation prompt is not how the template renders the turn it starts"
    role = message.body["role"]
    if message.reasoning and message.reasoning in earlier_span and message.reasoning not in later:
        return f"this {role} turn's reasoning (<think> block) is dropped from later renderings"
    if "<think>" in at_text:
        return f"this {role} turn's <think> block is dropped from later renderings"
    return f"this {role} message is rendered differently once later messages are appended"


def _check_pair(
    renderer: Renderer,
    conv: Conversation,
    earlier: str,
    earlier_cut: int,
    later: str,
    prefixes: list[str | None],
    gen_from: int | None,
    trigger: list[str],
) -> list[Break]:
    """Text and token prefix checks of ``earlier`` up to ``earlier_cut`` (where TITO joins
    the next piece) against ``later``; the breaks found, attributed to the changed message."""
    breaks: list[Break] = []
    earlier = earlier[:earlier_cut]
    at = _common_prefix(earlier, later)
    text_ok = at == len(earlier)
    early_ids = renderer.ids(earlier)
    late_ids = renderer.ids(later)
    token_at = _common_prefix(early_ids, late_ids)
    tokens_ok = token_at == len(early_ids)
    if text_ok and tokens_ok:
        return breaks
    if text_ok:
        at = len(renderer.tokenizer.decode(early_ids[:token_at], skip_special_tokens=False))
        at = min(at, len(earlier) - 1)
    index = _changed(earlier, at, prefixes, gen_from)
    message = None if index is None else conv.messages[index]
    if index is None:
        changed = trigger[-1] if trigger else "generation prompt"
    else:
        changed = conv.messages[index].kind
    span_start = 0 if index is None else len(prefixes[index] or "")
    window = earlier[max(0, at - len("<think>")) : at + len("<think>")]
    description = _describe(message, earlier[span_start:], later, window)
    breaks.append(
        Break(
            conversation=conv.name,
            level=LEVEL_TOKENS if text_ok else LEVEL_TEXT,
            trigger=trigger,
            changed=changed,
            changed_index=index,
            description=description
            if not text_ok
            else ("the text is preserved but the tokens at this point are merged differently"),
            char_index=at,
            earlier=_context(earlier, at),
            later=_context(later, at),
            token_index=token_at,
            earlier_tokens=[
                renderer.piece(t)
                for t in early_ids[max(0, token_at - CONTEXT_TOKENS) : token_at + CONTEXT_TOKENS]
            ],
            later_tokens=[
                renderer.piece(t)
                for t in late_ids[max(0, token_at - CONTEXT_TOKENS) : token_at + CONTEXT_TOKENS]
            ],
        )
    )
    return breaks


def _end_of_turn(
    renderer: Renderer, kind: str, continuation: str, stops: set[int]
) -> tuple[EndOfTurn, int]:
    """The end-of-turn marker of an assistant continuation and where it ends in it: the
    first stop token (where the model stops sampling), else the last added token that is
    not whitespace (reported as not a stop token)."""
    ids = renderer.ids(continuation)
    eos = renderer.tokenizer.eos_token_id
    first_stop = next((token for token in ids if token in stops), None)
    if first_stop is not None:
        marker = renderer.piece(first_stop)
        position = continuation.find(marker)
        end = len(continuation) if position < 0 else position + len(marker)
        found = EndOfTurn(kind, marker, first_stop, first_stop == eos, True, continuation[end:])
        return found, end
    added = set(renderer.tokenizer.added_tokens_decoder)
    index = len(ids) - 1
    while index >= 0 and not renderer.piece(ids[index]).strip():
        index -= 1
    if index < 0 or ids[index] not in added:
        return EndOfTurn(kind, None, None, False, False, ""), len(continuation)
    marker = renderer.piece(ids[index])
    position = continuation.rfind(marker)
    end = len(continuation) if position < 0 else position + len(marker)
    return EndOfTurn(kind, marker, ids[index], ids[index] == eos, False, continuation[end:]), end


def _content_break(
    conv: Conversation, index: int, continuation: str, vllm_messages: bool
) -> Break | None:
    """A break when the rendered assistant turn lacks what the model sampled."""
    message = conv.messages[index]
    # vLLM parses JSON-string arguments before rendering, so only a direct render has to
    # reproduce the string as sent.
    required = message.expect + (() if vllm_messages else message.json_arguments)
    for fragment in required:
        if fragment in continuation:
            continue
        if fragment in message.json_arguments:
            description = (
                "tool-call arguments given as a JSON string are re-serialised, not rendered as sent"
            )
        elif "tool_calls" in message.body and fragment.isascii():
            description = f"the template does not render this turn's tool calls ({fragment!r})"
        elif fragment.isascii():
            description = f"the rendered turn lacks {fragment!r}"
        else:
            description = f"the rendered turn lacks {fragment!r} (non-ASCII text is escaped)"
        return Break(
            conversation=conv.name,
            level=LEVEL_CONTENT,
            trigger=[message.kind],
            changed=message.kind,
            changed_index=index,
            description=description,
            earlier=repr(fragment),
            later=repr(continuation[: 4 * CONTEXT_CHARS]),
        )
    return None


def _audit_conversation(
    renderer: Renderer, conv: Conversation, stops: set[int], collector: _Collector
) -> str:
    """Run the checks of one conversation; return "ok" or why it stopped."""
    bodies = conv.bodies()
    count = len(bodies)
    prefixes: list[str | None] = [""]
    prefix_errors: dict[int, str] = {}
    for end in range(1, count + 1):
        try:
            prefixes.append(renderer.render(bodies[:end], conv.tools, False))
        except Exception as exc:  # a template may reject an incomplete conversation
            prefixes.append(None)
            prefix_errors[end] = f"{type(exc).__name__}: {exc}"
    assistants = [i for i, m in enumerate(conv.messages) if m.kind in ASSISTANT_KINDS]
    cut_text: str | None = None  # the last assistant-complete rendering, cut after its EOT
    cut_at = 0
    checkpoints = [*assistants, count]
    start = 0
    for point in checkpoints:
        trigger = [conv.messages[i].kind for i in range(start, point)]
        if point == count and point == start:
            break
        try:
            prompt = renderer.render(bodies[:point], conv.tools, True)
        except Exception as exc:
            _errored(collector, conv, start, f"{conv.name}: {type(exc).__name__}: {exc}")
            return f"stopped at message {point}: {type(exc).__name__}: {exc}"
        if cut_text is not None:
            history = [m.kind for m in conv.messages[:start]]
            collector.checked(history)
            for found in _check_pair(
                renderer, conv, cut_text, cut_at, prompt, prefixes, None, trigger
            ):
                collector.broke(found)
        if point == count:
            break
        kind = conv.messages[point].kind
        complete = prefixes[point + 1]
        if complete is None:
            why = f"cannot render it as the last turn: {prefix_errors[point + 1]}"
            _errored(collector, conv, point, f"{conv.name}: {why}")
            return f"stopped at message {point}: {why}"
        gen_from = len(prefixes[point] or "") if prefixes[point] is not None else None
        collector.checked([m.kind for m in conv.messages[: point + 1]])
        pair_breaks = _check_pair(
            renderer, conv, prompt, len(prompt), complete, prefixes, gen_from, [kind]
        )
        for found in pair_breaks:
            collector.broke(found)
        result = collector.results[kind]
        preserved = complete.startswith(prompt)
        # Where the turn starts: after the prompt, or (when the prompt itself is not kept)
        # after the history before it, so its end-of-turn marker is still found.
        turn_start = len(prompt) if preserved else len(prefixes[point] or "")
        continuation = complete[turn_start:]
        end_of_turn, eot_end = _end_of_turn(renderer, kind, continuation, stops)
        if result.end_of_turn is None or not end_of_turn.is_stop_token:
            result.end_of_turn = end_of_turn
        if continuation:
            content = _content_break(conv, point, continuation, renderer.vllm_messages)
            if content is not None:
                collector.broke(content)
            reasoning = conv.messages[point].reasoning
            if reasoning is not None:
                collector.reasoning_seen.setdefault(kind, []).append(reasoning in continuation)
        cut_text, cut_at = complete, turn_start + eot_end
        start = point + 1
    return "ok"


def _errored(collector: _Collector, conv: Conversation, start: int, error: str) -> None:
    for message in conv.messages[start:]:
        errors = collector.results[message.kind].errors
        if error not in errors:
            errors.append(error)


def _generation_prompt(renderer: Renderer) -> str:
    for conv in battery():
        bodies = conv.bodies()
        first = next(i for i, m in enumerate(conv.messages) if m.kind == "user") + 1
        try:
            without = renderer.render(bodies[:first], conv.tools, False)
            with_prompt = renderer.render(bodies[:first], conv.tools, True)
        except Exception:
            continue
        if with_prompt.startswith(without):
            return with_prompt[len(without) :]
    return ""


def _finish(collector: _Collector) -> list[KindResult]:
    results: list[KindResult] = []
    for kind in KIND_ORDER:
        result = collector.results[kind]
        seen = collector.reasoning_seen.get(kind)
        if kind in REASONING_KINDS and seen:
            result.renders_reasoning = any(seen)
        if result.checks == 0:
            result.status = STATUS_UNSUPPORTED if result.errors else STATUS_UNTESTED
        else:
            if result.prefix_preserving is None:
                result.prefix_preserving = True
            if result.token_prefix_preserving is None:
                result.token_prefix_preserving = True
            if result.break_ is not None:
                result.status = STATUS_FAIL
            elif result.renders_reasoning is False:
                result.status = STATUS_IGNORED
            else:
                result.status = STATUS_PASS
        results.append(result)
    return results


def _difference(kind: str, found: Break) -> str:
    """A faithfulness difference: the kind, the cause and the exact first difference."""
    where = f"{found.level} break in '{found.conversation}' when "
    where += f"{', '.join(found.trigger) or 'nothing'} is appended"
    if found.char_index is not None:
        where += f"; first difference at char {found.char_index}"
        if found.token_index is not None:
            where += f", token {found.token_index}"
        where += f": {found.earlier} became {found.later}"
    else:
        where += f": {found.earlier} is not in {found.later}"
    return f"{kind}: {found.description} ({where})"


def _verdict(kinds: list[KindResult], stops: set[int]) -> tuple[list[str], list[str], list[str]]:
    """Exactness reasons, faithfulness differences and warnings."""
    reasons: list[str] = []
    differences: list[str] = []
    warnings: list[str] = []
    for result in kinds:
        if result.status == STATUS_FAIL and result.break_ is not None:
            differences.append(_difference(result.kind, result.break_))
        elif result.status == STATUS_IGNORED:
            warnings.append(
                f"{result.kind}: the template does not render this reasoning field, so a "
                "re-render lacks the reasoning the model sampled"
            )
        elif result.status == STATUS_UNSUPPORTED:
            warnings.append(f"{result.kind}: not supported by the template ({result.errors[0]})")
        end = result.end_of_turn
        # Whether TITO finds where the turn ends (a stop token the model samples, maybe
        # the next message's header) is ``check_exact``'s question, over the following
        # messages: a turn rendered as the last message may be left open or end with a
        # marker the model does not stop on. Noted here as a warning.
        if end is not None and end.marker is not None and not end.is_stop_token:
            marker = repr(end.marker)
            warnings.append(
                f"{result.kind}: the assistant turn ends with {marker}, which is not a token the "
                f"model stops on (stop ids {sorted(stops)}), so the sampled completion does not "
                "end where the template's turn does"
            )
    return reasons, differences, warnings


def audit_template(
    tokenizer: Any,
    template: str | None = None,
    *,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    stop_token_ids: Sequence[int] = (),
    vllm_messages: bool = True,
    suggest_fixes: bool = True,
) -> AuditReport:
    """Audit a chat template for TITO safety.

    ``tokenizer``: a Hugging Face tokenizer, a ``turnstile.output.tokenizer.LocalTokenizer`` or a
    tokenizer directory. ``template``: the Jinja text to audit (default: the tokenizer's
    own). ``chat_template_kwargs`` are passed to every rendering (as vLLM's request field of
    that name does); ``stop_token_ids`` add to EOS and ``generation_config.json``'s stop
    tokens. ``vllm_messages``: render the messages as vLLM passes them to the template
    (``as_vllm_renders``); False renders them exactly as given, as a direct
    ``apply_chat_template`` call does. With ``suggest_fixes``, known remedies are looked up
    and, where they are template flags, re-audited. Raises ``AuditError`` when there is no
    template or it renders nothing.
    """
    hf = hf_tokenizer(tokenizer)
    source = "argument"
    if template is None:
        template = getattr(hf, "chat_template", None)
        source = "tokenizer"
        if isinstance(template, dict):
            template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str) or not template.strip():
        raise AuditError("no chat template: the tokenizer has none and none was given")
    kwargs = dict(chat_template_kwargs or {})
    renderer = Renderer(hf, template, kwargs, vllm_messages)
    stops = stop_ids(hf, stop_token_ids)
    generation_prompt = _generation_prompt(renderer)
    open_think = (
        "<think>" in generation_prompt and "</think>" not in generation_prompt.split("<think>")[-1]
    )
    collector = _Collector()
    outcomes = {
        conv.name: _audit_conversation(renderer, conv, stops, collector)
        for conv in battery(open_think)
    }
    kinds = _finish(collector)
    if not any(result.checks for result in kinds):
        raise AuditError(
            "the template renders none of the audit's conversations: "
            + "; ".join(f"{name}: {outcome}" for name, outcome in outcomes.items())
        )
    reasons, differences, warnings = _verdict(kinds, stops)
    _exact, exact_reasons = check_exact(hf, template, kwargs, sorted(stops), battery(open_think))
    reasons += [reason for reason in exact_reasons if reason not in reasons]
    if any(marker in template for marker in _CLOCK_MARKERS):
        warnings.append(
            "the template reads the clock (strftime_now): renderings on different days differ, "
            "so a rollout that spans midnight is not prefix-preserving"
        )
    report = AuditReport(
        tokenizer=str(getattr(hf, "name_or_path", "")),
        template_source=source,
        template_sha256=hashlib.sha256(template.encode()).hexdigest(),
        chat_template_kwargs=kwargs,
        vllm_messages=vllm_messages,
        exact_reasons=reasons,
        differences=differences,
        warnings=warnings,
        fixes=[],
        kinds=kinds,
        stop_token_ids=sorted(stops),
        generation_prompt=generation_prompt,
        conversations=outcomes,
    )
    if suggest_fixes and not report.tito_safe:

        def reaudit(text: str, flag: dict[str, Any]) -> AuditReport:
            return audit_template(
                hf,
                text,
                chat_template_kwargs={**kwargs, **flag},
                stop_token_ids=stop_token_ids,
                vllm_messages=vllm_messages,
                suggest_fixes=False,
            )

        report.fixes = known_fixes(template, report, reaudit)
    return report
