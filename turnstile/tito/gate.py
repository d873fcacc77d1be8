"""Building TITO mode at start-up: the template, its audit gate and the output parsers.

TITO mode renders with the tokenizer's chat template (or `chat_template`, a file) and the
`chat_template_kwargs` defaults from settings. The template is audited first
(`turnstile.tito.templates.audit_template`), which answers two questions:

* TITO-exact: can the delta be found, so every sample equals the token stream? A template
  that is not is always refused (unless `allow_unsafe_template`).
* Deployment-faithful: does the accumulated context equal what the template renders for
  the same messages? With `tito_history: sampled` (the default) a template that is not is
  used with a warning naming the first difference (TITO keeps what the model sampled);
  with `tito_history: template` it is refused, as before.

Either way a known fix verified by the audit is used when `tito_apply_fixes` is on (the
fixed template, e.g. Qwen3's with earlier reasoning kept, is then used and logged).
The output parsers come from the template's text unless `tool_parser` /
`reasoning_parser` name them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from turnstile.backends.protocol import Backend
from turnstile.tito.engine import RewritePolicy, TitoEngine
from turnstile.tito.parsers import ParserSpec, parser_for_template
from turnstile.tito.render import TemplateRenderer
from turnstile.tito.templates import AuditError, AuditReport, Fix, audit_template

__all__ = [
    "HISTORY_MODES",
    "HistoryMode",
    "TemplateChoice",
    "TemplateRefused",
    "build_engine",
    "choose_template",
]

# What TITO's context is held to: what the model sampled, or the template's own rendering.
HistoryMode = Literal["sampled", "template"]
HISTORY_MODES: tuple[HistoryMode, ...] = ("sampled", "template")

log = logging.getLogger("turnstile.tito")


class TemplateRefused(Exception):
    """The chat template failed the audit and TITO mode was not told to accept it."""


@dataclass
class TemplateChoice:
    """The template TITO renders with, and why."""

    template: str
    kwargs: dict[str, Any]
    report: AuditReport
    fixed: str | None = None  # the fix applied, if any
    warnings: list[str] = field(default_factory=list)


def _template_text(hf: Any, path: Path | None) -> str:
    if path is not None:
        try:
            return path.read_text(encoding="utf-8")
        except OSError as exc:
            raise TemplateRefused(f"cannot read the chat template {path}: {exc}") from exc
    template = getattr(hf, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str) or not template.strip():
        raise TemplateRefused("the tokenizer has no chat template: pass chat_template (a file)")
    return template


def applicable_fixes(report: AuditReport) -> list[Fix]:
    """The fixes of `report` TITO mode can apply itself: verified, and made of template
    variables or a patched template."""
    return [
        fix
        for fix in report.fixes
        if fix.verified and (fix.chat_template_kwargs or fix.template is not None)
    ]


def choose_template(
    hf: Any,
    template_path: Path | None,
    kwargs: dict[str, Any],
    *,
    apply_fixes: bool = True,
    allow_unsafe: bool = False,
    stop_token_ids: tuple[int, ...] = (),
    history: HistoryMode = "sampled",
) -> TemplateChoice:
    """Audit the template and decide what TITO renders with (or refuse)."""
    template = _template_text(hf, template_path)
    try:
        report = audit_template(
            hf, template, chat_template_kwargs=kwargs, stop_token_ids=stop_token_ids
        )
    except AuditError as exc:
        raise TemplateRefused(f"the chat template cannot be audited: {exc}") from exc
    if report.tito_safe:
        return TemplateChoice(template, kwargs, report, warnings=list(report.warnings))
    if not report.tito_exact:
        reasons = "; ".join(report.exact_reasons)
        if allow_unsafe:
            return TemplateChoice(
                template, kwargs, report, warnings=[f"template is not TITO-exact: {reasons}"]
            )
        raise TemplateRefused(
            f"the chat template is not TITO-exact (not safe for TITO mode): {reasons} "
            "(see `turnstile check-template`; allow_unsafe_template accepts it anyway)"
        )
    verified = applicable_fixes(report)
    if apply_fixes and verified:
        fix = verified[0]
        patched = fix.template
        fixed_template = patched or template
        fixed_kwargs = {**kwargs, **(fix.chat_template_kwargs or {})}
        after = audit_template(
            hf,
            fixed_template,
            chat_template_kwargs=fixed_kwargs,
            stop_token_ids=stop_token_ids,
            suggest_fixes=False,
        )
        if after.tito_safe:
            what = "patched template" if patched else "template"
            if fix.chat_template_kwargs:
                what += f" with {fix.chat_template_kwargs}"
            return TemplateChoice(
                fixed_template, fixed_kwargs, after, fixed=what, warnings=list(after.warnings)
            )
    reasons = "; ".join(report.reasons)
    if history == "sampled":
        unfaithful = (
            "TITO is exact with this template, but its context is not what the template "
            "renders for the same messages (TITO keeps what the model sampled; "
            "tito_history: template refuses this): " + "; ".join(report.differences)
        )
        return TemplateChoice(template, kwargs, report, warnings=[unfaithful, *report.warnings])
    if allow_unsafe:
        return TemplateChoice(
            template, kwargs, report, warnings=[f"template failed the TITO audit: {reasons}"]
        )
    fixes = " ".join(f"Fix: {fix.description}" for fix in report.fixes)
    raise TemplateRefused(
        f"the chat template is not safe for TITO mode with tito_history: template (its "
        f"context is not what the template renders): {reasons}. {fixes} "
        "(see `turnstile check-template`; tito_history: sampled keeps what the model "
        "sampled instead; allow_unsafe_template accepts it anyway)"
    )


def build_engine(
    backend: Backend,
    hf: Any,
    *,
    template_path: Path | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    on_rewrite: RewritePolicy = "split",
    apply_fixes: bool = True,
    allow_unsafe: bool = False,
    tool_parser: str | None = None,
    reasoning_parser: str | None = None,
    stop_token_ids: tuple[int, ...] = (),
    history: HistoryMode = "sampled",
    image_token_id: int | None = None,
) -> TitoEngine:
    """The TITO engine for `hf` (a Hugging Face tokenizer) in front of `backend`."""
    choice = choose_template(
        hf,
        template_path,
        dict(chat_template_kwargs or {}),
        apply_fixes=apply_fixes,
        allow_unsafe=allow_unsafe,
        stop_token_ids=stop_token_ids,
        history=history,
    )
    if choice.fixed:
        log.warning("TITO: the chat template failed the audit; using the %s", choice.fixed)
    for warning in choice.warnings:
        log.warning("TITO: %s", warning)
    spec = parser_for_template(choice.template)
    if tool_parser is not None or reasoning_parser is not None:
        spec = ParserSpec(
            tool_parser or spec.tool,
            reasoning_parser if reasoning_parser is not None else spec.reasoning,
            spec.starts_in_reasoning if reasoning_parser is None else None,
        )
    renderer = TemplateRenderer(hf, choice.template, choice.kwargs, stop_token_ids)
    engine = TitoEngine(backend, renderer, spec, on_rewrite, image_token_id)
    engine.template_info = {
        "template_sha256": choice.report.template_sha256,
        "fixed": choice.fixed,
        "tito_safe": choice.report.tito_safe,
        "tito_exact": choice.report.tito_exact,
        "deployment_faithful": choice.report.deployment_faithful,
        "history": history,
        "tool_parser": spec.tool,
        "reasoning_parser": spec.reasoning,
    }
    log.info(
        "TITO mode: parsers %s/%s, template %s",
        spec.tool,
        spec.reasoning,
        choice.report.template_sha256[:12],
    )
    return engine
