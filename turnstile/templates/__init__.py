"""Chat template audits: which templates are safe for token-in-token-out (TITO) stitching.

* ``audit_template(tokenizer, template=None) -> AuditReport`` renders a battery of
  conversations and checks, per message kind, that each rendering extends the previous one
  where TITO joins prompt, sampled completion and new messages (``audit``, ``battery``);
* ``build_tokenizer_dir`` / ``ensure_vocab_tokenizer`` build Hugging Face tokenizers from
  llama.cpp's vendored vocabularies (``vocab``);
* ``audit_corpus`` audits every vendored template that pairs with a vendored vocabulary
  (``corpus``); ``known_fixes`` / ``keep_reasoning_patch`` hold the known remedies (``fixes``).

``turnstile check-template`` is the command-line front end.
"""

from turnstile.templates.audit import as_vllm_renders, audit_template
from turnstile.templates.corpus import PAIRINGS, CorpusRow, audit_corpus, corpus_markdown
from turnstile.templates.fixes import keep_reasoning_patch, known_fixes
from turnstile.templates.model import (
    AuditError,
    AuditReport,
    Break,
    EndOfTurn,
    Fix,
    KindResult,
)
from turnstile.templates.report import format_report
from turnstile.templates.vocab import (
    VocabSpec,
    build_tokenizer_dir,
    ensure_vocab_tokenizer,
    load_tokenizer,
)

__all__ = [
    "PAIRINGS",
    "AuditError",
    "AuditReport",
    "Break",
    "CorpusRow",
    "EndOfTurn",
    "Fix",
    "KindResult",
    "VocabSpec",
    "as_vllm_renders",
    "audit_corpus",
    "audit_template",
    "build_tokenizer_dir",
    "corpus_markdown",
    "ensure_vocab_tokenizer",
    "format_report",
    "keep_reasoning_patch",
    "known_fixes",
    "load_tokenizer",
]
