"""Known remedies for templates that fail the TITO audit.

Where a remedy is a template flag or a small, well-known rewrite, it is applied and the
template re-audited, so the report says whether it actually makes the template pass.

* Reasoning dropped from history: several families gate earlier turns' reasoning on a flag
  (Qwen3.6 ``preserve_thinking``, GLM-4.7 ``clear_thinking``, LFM2.5 ``keep_past_thinking``,
  Nemotron-3 ``truncate_history_thinking``). Qwen3, QwQ and Qwen3.5 templates have none: they
  render ``<think>`` only for assistant turns after the last user query
  (``ns.last_query_index``). ``keep_reasoning_patch`` rewrites that condition the way Qwen3.6's
  template does.
* Tool-call arguments re-serialised, non-ASCII escaped, end-of-turn not a stop token: described.

The re-audit is the caller's (``Reaudit``): ``turnstile.tito.templates.audit`` passes one that
audits with the same tokenizer, stop tokens and message handling, so this module depends on
the report model only.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from turnstile.tito.templates.model import AuditReport, Fix

__all__ = ["KEEP_REASONING_FLAGS", "Reaudit", "keep_reasoning_patch", "known_fixes"]

# Audits ``template`` with these template variables added to the failing report's (and no
# fixes looked up): how a remedy is verified.
Reaudit = Callable[[str, dict[str, Any]], AuditReport]

# Template variables that keep earlier turns' reasoning, and the value that keeps it.
KEEP_REASONING_FLAGS: dict[str, bool] = {
    "preserve_thinking": True,  # Qwen3.6, LFM2.5-8B, Laguna
    "clear_thinking": False,  # GLM-4.7
    "keep_past_thinking": True,  # LFM2.5-Instruct
    "truncate_history_thinking": False,  # Nemotron-3
}
# Qwen3.6's condition for rendering an assistant turn's <think> block.
_QWEN36_CONDITION = (
    "(preserve_thinking is defined and preserve_thinking is true) or loop.index0 > "
    "ns.last_query_index"
)
_QWEN_LAST_QUERY = re.compile(r"(?<![\w.(])loop\.index0 > ns\.last_query_index")
# Qwen3's inner condition that still leaves out empty <think> blocks of non-final turns.
_QWEN3_EMPTY_THINK = "loop.last or (not loop.last and reasoning_content)"


def keep_reasoning_patch(template: str) -> str | None:
    """Rewrite a Qwen3/QwQ/Qwen3.5-style template to render every assistant turn's
    ``<think>`` block when ``preserve_thinking`` is true, as Qwen3.6's template does; None when
    the template has no such condition or already has the flag."""
    if "preserve_thinking" in template or not _QWEN_LAST_QUERY.search(template):
        return None
    patched = _QWEN_LAST_QUERY.sub(_QWEN36_CONDITION, template, count=1)
    return patched.replace(
        _QWEN3_EMPTY_THINK,
        f"(preserve_thinking is defined and preserve_thinking is true) or {_QWEN3_EMPTY_THINK}",
    )


def _reasoning_broken(report: AuditReport) -> bool:
    """Whether a break drops reasoning, or comes from a generation prompt that opens a
    <think> block the history does not render."""
    for result in report.kinds:
        found = result.break_
        if found is None:
            continue
        if "<think>" in found.description or "reasoning" in found.description:
            return True
        if "generation prompt" in found.description and "<think>" in report.generation_prompt:
            return True
    return False


def _outcome(after: AuditReport) -> str:
    if after.tito_safe:
        return "re-audited with it: TITO-safe."
    return "re-audited with it: still failing (" + ", ".join(after.failing_kinds()) + ")."


def known_fixes(template: str, report: AuditReport, reaudit: Reaudit) -> list[Fix]:
    """The remedies that apply to a failing ``report`` of ``template``, those that are
    template flags or rewrites verified with ``reaudit``."""
    fixes: list[Fix] = []
    if _reasoning_broken(report):
        flagged = False
        for name, value in KEEP_REASONING_FLAGS.items():
            if name not in template:
                continue
            flagged = True
            flag = {name: value}
            after = reaudit(template, flag)
            fixes.append(
                Fix(
                    f"the template keeps earlier turns' reasoning when {name}={value!r}: pass "
                    f'chat_template_kwargs {{"{name}": {str(value).lower()}}} with every '
                    "request (vLLM: --default-chat-template-kwargs); " + _outcome(after),
                    chat_template_kwargs=flag,
                    verified=after.tito_safe,
                )
            )
        patched = None if flagged else keep_reasoning_patch(template)
        if patched is not None:
            flag = {"preserve_thinking": True}
            after = reaudit(patched, flag)
            fixes.append(
                Fix(
                    "the template renders <think> blocks only for assistant turns after the "
                    "last user message (ns.last_query_index) and has no flag to keep them, so "
                    "every new user message drops the earlier turns' reasoning (and Qwen3 "
                    "also drops the empty <think></think> of turns without reasoning). "
                    "Qwen3.6's template adds one: it renders the block when "
                    f"`{_QWEN36_CONDITION}`, enabled with chat_template_kwargs "
                    '{"preserve_thinking": true}. Serve this model with its template patched '
                    "the same way (turnstile.tito.templates.keep_reasoning_patch; vLLM "
                    "--chat-template FILE) and that flag, or accept a split training sequence "
                    "at each new user message (TITO keeps the sampled tokens, which a "
                    "re-render no longer reproduces). The model was trained without earlier "
                    "reasoning in its context, so keeping it changes what it sees; "
                    + _outcome(after),
                    chat_template_kwargs=flag,
                    verified=after.tito_safe,
                )
            )
        elif not flagged:
            fixes.append(
                Fix(
                    "the template drops assistant reasoning from history (or its generation "
                    "prompt opens a <think> block the history does not render) and has no flag "
                    "to keep it: serve a template that renders every turn's <think>...</think> "
                    "as sampled, or accept a split training sequence at every turn."
                )
            )
    descriptions = " ".join(
        result.break_.description for result in report.kinds if result.break_ is not None
    )
    if "re-serialised" in descriptions:
        fixes.append(
            Fix(
                "the template re-serialises tool-call arguments given as JSON strings. vLLM "
                "parses them into dicts before rendering, so the template serialises them "
                "itself either way: a re-render reproduces the model's own argument bytes "
                "(which TITO keeps) only if the model formats JSON as the template's tojson "
                "does."
            )
        )
    if "non-ASCII" in descriptions:
        fixes.append(
            Fix(
                "the template escapes non-ASCII text in tool-call arguments (tojson with "
                "ensure_ascii): use tojson(ensure_ascii=False) so a re-render keeps the "
                "characters the model sampled."
            )
        )
    if any("not a token the model stops on" in reason for reason in report.reasons):
        fixes.append(
            Fix(
                "add the assistant's end-of-turn token to generation_config.json's "
                "eos_token_id (vLLM stops on those and returns the token with the completion), "
                "or send it as a stop token id with every request."
            )
        )
    return fixes
