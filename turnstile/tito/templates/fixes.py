"""Known remedies for templates that fail the TITO audit.

Where a remedy is a template flag or a small, well-known rewrite, it is applied and the
template re-audited, so the report says whether it actually makes the template pass.

* Reasoning dropped from history: several families gate earlier turns' reasoning on a flag
  (Qwen3.6 ``preserve_thinking``, GLM-4.7 ``clear_thinking``, LFM2.5 ``keep_past_thinking``,
  Nemotron-3 ``truncate_history_thinking``). Qwen3, QwQ and Qwen3.5 templates have none: they
  render ``<think>`` only for assistant turns after the last user query
  (``ns.last_query_index``). ``keep_reasoning_patch`` rewrites that condition the way Qwen3.6's
  template does.
* DeepSeek-R1 distills and QwQ drop the reasoning of every earlier turn (their templates
  keep only what follows ``</think>``) and render no ``reasoning_content``:
  ``r1_keep_reasoning_patch`` / ``qwq_keep_reasoning_patch`` render each turn's reasoning
  as the model samples it (``<think>\n`` ... ``</think>``) when ``preserve_thinking`` is
  true.
* Hermes 2 Pro / 3 render a tool response without its trailing newline while it is the
  last message, and with it once another follows: ``hermes_tool_response_patch`` renders it
  the same way in both.
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

__all__ = [
    "KEEP_REASONING_FLAGS",
    "Reaudit",
    "hermes_tool_response_patch",
    "keep_reasoning_patch",
    "known_fixes",
    "qwq_keep_reasoning_patch",
    "r1_keep_reasoning_patch",
]

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


_KEEP = "(preserve_thinking is defined and preserve_thinking)"
# DeepSeek-R1 distills: the assistant turn keeps only what follows </think>.
_R1_DROP = (
    "{%- set content = message['content'] -%}\n"
    "      {%- if '</think>' in content -%}\n"
    "        {%- set content = content.split('</think>')[-1] -%}\n"
    "      {%- endif -%}{{'<\uff5cAssistant\uff5c>' + content + "
    "'<\uff5cend\u2581of\u2581sentence\uff5c>'}}"
)
_R1_KEEP = (
    "{%- set content = message['content'] -%}\n"
    "      {%- if " + _KEEP + " -%}\n"
    "        {%- if '</think>' in content -%}"
    "{%- set content = '<think>\\n' + content.split('<think>')[-1].lstrip('\\n') -%}\n"
    "        {%- elif message['reasoning_content'] is defined and "
    "message['reasoning_content'] -%}"
    "{%- set content = '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' "
    "+ content -%}\n"
    "        {%- else -%}{%- set content = '<think>\\n</think>\\n\\n' + content -%}\n"
    "        {%- endif -%}\n"
    "      {%- elif '</think>' in content -%}\n"
    "        {%- set content = content.split('</think>')[-1] -%}\n"
    "      {%- endif -%}{{'<\uff5cAssistant\uff5c>' + content + "
    "'<\uff5cend\u2581of\u2581sentence\uff5c>'}}"
)
# QwQ: an earlier turn keeps only what follows </think>; reasoning_content is not read.
_QWQ_DROP = (
    "{%- set content = message.content %}\n"
    "        {%- if not loop.last %}\n"
    "            {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}\n"
    "        {%- endif %}"
)
_QWQ_KEEP = (
    "{%- set content = message.content %}\n"
    "        {%- if " + _KEEP + " %}\n"
    "            {%- if '</think>' in content %}\n"
    "                {%- set content = '<think>\\n' + "
    "content.split('<think>')[-1].lstrip('\\n') %}\n"
    "            {%- elif message.reasoning_content %}\n"
    "                {%- set content = '<think>\\n' + message.reasoning_content + "
    "'\\n</think>\\n\\n' + content %}\n"
    "            {%- else %}\n"
    "                {%- set content = '<think>\\n</think>\\n\\n' + content %}\n"
    "            {%- endif %}\n"
    "        {%- elif not loop.last %}\n"
    "            {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}\n"
    "        {%- endif %}"
)
# Hermes 2 Pro / 3: the last tool response lacks the newline it has once another follows.
_HERMES_LAST_TOOL = "{%- else %}\n            {{- '\n</tool_response>' }}"
_HERMES_FIXED = "{%- else %}\n            {{- '\n</tool_response>\n' }}"


# R1 distills' first tool call of a turn, opened without the <think> block.
_R1_CALLS = "{{'<\uff5cAssistant\uff5c><\uff5ctool\u2581calls\u2581begin\uff5c>"
_R1_CALLS_KEEP = (
    "{{'<\uff5cAssistant\uff5c>' + ((('<think>\\n' + message['reasoning_content'] + "
    "'\\n</think>\\n\\n') if (message['reasoning_content'] is defined and "
    "message['reasoning_content']) else '<think>\\n</think>\\n\\n') if " + _KEEP + " "
    "else '') + '<\uff5ctool\u2581calls\u2581begin\uff5c>"
)
# QwQ's tool-call turn: the content (with the reasoning kept, the <think> block) only when
# there is content.
_QWQ_CALLS = "{{- '<|im_start|>' + message.role }}\n        {%- if message.content %}"
_QWQ_CALLS_KEEP = (
    "{{- '<|im_start|>' + message.role }}\n        {%- if message.content or " + _KEEP + " %}"
)


# R1 distills: a tool-call turn after tool outputs does not close them (a text turn does),
# and `ns.is_first` is never reset, so every tool-call turn after the first renders its
# calls without the Assistant marker and the tool-calls-begin marker (a later turn's first call is
# written as if it continued the previous turn's list).
_R1_TOOL_ROUND = (
    "{%- if message['role'] == 'assistant' and message['tool_calls'] -%}\n"
    "    {%- set ns.is_tool = false -%}"
)
_R1_TOOL_ROUND_KEEP = (
    "{%- if message['role'] == 'assistant' and message['tool_calls'] -%}\n"
    "    {%- if " + _KEEP + " -%}"
    "{%- if ns.is_tool -%}{{'<\uff5ctool\u2581outputs\u2581end\uff5c>'}}{%- endif -%}"
    "{%- set ns.is_first = false -%}{%- endif -%}\n"
    "    {%- set ns.is_tool = false -%}"
)


def r1_keep_reasoning_patch(template: str) -> str | None:
    """A DeepSeek-R1-distill template that renders each assistant turn's reasoning (from
    ``reasoning_content`` or a ``<think>`` block in the content) after ``<think>\n``, as
    the model samples it after the generation prompt, when ``preserve_thinking`` is true;
    None when the template is not one of these."""
    if _R1_DROP not in template or "preserve_thinking" in template:
        return None
    patched = template.replace(_R1_DROP, _R1_KEEP).replace(_R1_CALLS, _R1_CALLS_KEEP)
    return patched.replace(_R1_TOOL_ROUND, _R1_TOOL_ROUND_KEEP)


def qwq_keep_reasoning_patch(template: str) -> str | None:
    """QwQ's template rendering every assistant turn's reasoning after ``<think>\n`` when
    ``preserve_thinking`` is true; None when the template is not QwQ's."""
    if template.count(_QWQ_DROP) == 0 or "preserve_thinking" in template:
        return None
    return template.replace(_QWQ_DROP, _QWQ_KEEP).replace(_QWQ_CALLS, _QWQ_CALLS_KEEP)


def hermes_tool_response_patch(template: str) -> str | None:
    """A Hermes template whose last tool response ends with the newline it has once
    another message follows; None when the template is not one of these."""
    if _HERMES_LAST_TOOL not in template:
        return None
    return template.replace(_HERMES_LAST_TOOL, _HERMES_FIXED)


# Rewrites that keep earlier reasoning, each verified with preserve_thinking=true.
_KEEP_PATCHES = (
    ("Qwen3/Qwen3.5", keep_reasoning_patch),
    ("DeepSeek-R1 distill", r1_keep_reasoning_patch),
    ("QwQ", qwq_keep_reasoning_patch),
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
        patched, family = None, ""
        for name, patch in () if flagged else _KEEP_PATCHES:
            patched = patch(template)
            if patched is not None:
                family = name
                break
        if patched is not None and family != "Qwen3/Qwen3.5":
            flag = {"preserve_thinking": True}
            if "enable_thinking" in template:  # llama.cpp's copies can turn thinking off
                flag["enable_thinking"] = True
            after = reaudit(patched, flag)
            fixes.append(
                Fix(
                    f"the {family} template keeps only what follows </think> in earlier "
                    "assistant turns, so every new message drops the reasoning the model "
                    "sampled. The patched template renders each turn's reasoning after "
                    '<think>\n, as sampled, with chat_template_kwargs {"preserve_thinking": '
                    "true} (vLLM --chat-template FILE for record mode; TITO mode uses it "
                    "itself). The model was trained without earlier reasoning in its "
                    "context, so keeping it changes what it sees; " + _outcome(after),
                    chat_template_kwargs=flag,
                    verified=after.tito_safe,
                    template=patched,
                )
            )
        elif patched is not None:
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
                    template=patched,
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
    hermes = hermes_tool_response_patch(template)
    if hermes is not None and any(
        result.kind == "tool" and result.break_ is not None for result in report.kinds
    ):
        after = reaudit(hermes, {})
        fixes.append(
            Fix(
                "the template renders a tool response without its trailing newline while it "
                "is the last message and with it once another follows, so the context of "
                "the turn after a tool call differs from a re-render. The patched template "
                "renders it the same way in both (as the model saw it in training, where a "
                "tool response is always followed); " + _outcome(after),
                chat_template_kwargs={},
                verified=after.tito_safe,
                template=hermes,
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
    if any(
        "not a token the model stops on" in reason or "does not end with a token" in reason
        for reason in [*report.reasons, *report.warnings]
    ):
        fixes.append(
            Fix(
                "add the assistant's end-of-turn token to generation_config.json's "
                "eos_token_id (vLLM stops on those and returns the token with the completion), "
                "or send it as a stop token id with every request."
            )
        )
    return fixes
