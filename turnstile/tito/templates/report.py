"""Human-readable form of a template audit report (``turnstile check-template``)."""

from __future__ import annotations

from turnstile.tito.templates.model import STATUS_FAIL, AuditReport, KindResult

__all__ = ["format_report"]

_KIND_WIDTH = 42


def _mark(value: bool | None) -> str:
    return {True: "ok", False: "BREAK", None: "-"}[value]


def _kind_line(result: KindResult) -> str:
    end = result.end_of_turn
    if end is None:
        eot = ""
    elif end.marker is None:
        eot = "  end: no special token"
    else:
        stop = "stop token" if end.is_stop_token else "NOT a stop token"
        eot = f"  end: {end.marker!r} ({'EOS, ' if end.is_eos else ''}{stop})"
    text = _mark(result.prefix_preserving)
    tokens = _mark(result.token_prefix_preserving)
    return (
        f"  {result.kind:<{_KIND_WIDTH}} {result.status:<11} text {text:<5} tokens {tokens:<5}{eot}"
    )


def format_report(report: AuditReport, label: str) -> str:
    """The report as terminal text; ``label`` names what was audited."""
    verdict = "TITO-safe" if report.tito_safe else "NOT TITO-safe"
    exact = "yes" if report.tito_exact else "NO (refused in TITO mode)"
    faithful = "yes" if report.deployment_faithful else "no (a warning with --tito-history sampled)"
    lines = [
        f"template audit: {label}",
        f"tokenizer: {report.tokenizer}",
        f"generation prompt: {report.generation_prompt!r}",
        f"stop token ids: {report.stop_token_ids}",
    ]
    if report.chat_template_kwargs:
        lines.append(f"chat_template_kwargs: {report.chat_template_kwargs}")
    lines += ["", "message kinds:"]
    for result in report.kinds:
        lines.append(_kind_line(result))
        found = result.break_
        if result.status == STATUS_FAIL and found is not None:
            lines.append(f"      {found.level} break: {found.description}")
            trigger = ", ".join(found.trigger) or "nothing"
            where = f"char {found.char_index}" if found.char_index is not None else "content"
            if found.token_index is not None:
                where += f", token {found.token_index}"
            lines.append(f"      in '{found.conversation}' when {trigger} is appended ({where})")
            lines.append(f"        earlier: {found.earlier}")
            lines.append(f"        later:   {found.later}")
            if found.earlier_tokens or found.later_tokens:
                lines.append(f"        earlier tokens: {found.earlier_tokens}")
                lines.append(f"        later tokens:   {found.later_tokens}")
        elif result.errors:
            lines.append(f"      {result.errors[0]}")
    lines += ["", f"TITO-exact: {exact}", f"deployment-faithful: {faithful}"]
    lines += [f"verdict: {verdict}"]
    lines += [f"  reason: {reason}" for reason in report.exact_reasons]
    lines += [f"  difference: {difference}" for difference in report.differences]
    lines += [f"  warning: {warning}" for warning in report.warnings]
    for fix in report.fixes:
        status = {True: " [verified]", False: " [does not fix it]", None: ""}[fix.verified]
        lines.append(f"  fix{status}: {fix.description}")
    return "\n".join(lines) + "\n"
