"""Chat template audits: which templates are safe for token-in-token-out (TITO) stitching.

* ``audit_template(tokenizer, template=None) -> AuditReport`` renders a battery of
  conversations and checks, per message kind, that each rendering extends the previous one
  where TITO joins prompt, sampled completion and new messages (``audit``, ``battery``);
* ``known_fixes`` / ``keep_reasoning_patch`` hold the known remedies (``fixes``).

``turnstile check-template`` is the command-line front end; the corpus of vendored
templates and the vocabularies they are audited with are development tooling
(``turnstile.dev.template_corpus``, ``turnstile.dev.vocab``).
"""

from turnstile.tito.templates.audit import as_vllm_renders, audit_template
from turnstile.tito.templates.fixes import keep_reasoning_patch, known_fixes
from turnstile.tito.templates.model import (
    AuditError,
    AuditReport,
    Break,
    EndOfTurn,
    Fix,
    KindResult,
)
from turnstile.tito.templates.report import format_report

__all__ = [
    "AuditError",
    "AuditReport",
    "Break",
    "EndOfTurn",
    "Fix",
    "KindResult",
    "as_vllm_renders",
    "audit_template",
    "format_report",
    "keep_reasoning_patch",
    "known_fixes",
]
