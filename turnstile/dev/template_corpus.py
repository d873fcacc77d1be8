"""The template corpus: every chat template llama.cpp vendors, each with a vocabulary.

llama.cpp vendors about 70 verbatim chat templates and a few real vocabularies
(``turnstile.dev.llama_cpp_assets.ensure_llama_cpp_assets``). ``PAIRINGS`` maps each template that
belongs to a family with a vendored vocabulary to a ``VocabSpec`` for that family: the
model's own vocabulary, or one of the same family (``FAMILY_PAIRED``: R1 distills on their
base model's vocabulary, Hermes and SmolLM3 on Llama 3's, Qwen3.5 on llama.cpp's qwen35
test vocabulary). Every other template is audited at text level
(``turnstile.dev.template_families``). ``audit_corpus`` audits every template (results
cached by a digest of the inputs and the audit's code) and returns a row per template with
both answers (TITO-exact, deployment-faithful) and the reason; ``corpus_markdown`` formats
it for the README and docs/tito.md.

Family specs: Qwen2.5/Qwen3/QwQ share the Qwen2 vocabulary (Qwen3 adds four tokens);
Qwen3.5's real vocabulary is not vendored, llama.cpp's ``qwen35`` test vocabulary has
Qwen2's tokens with Qwen3.5's pre-tokenizer, so ids differ from the real model's. Llama 3.1+
renames three reserved slots of the Llama 3 vocabulary (``<|finetune_right_pad_id|>``,
``<|eom_id|>``, ``<|python_tag|>``). DeepSeek-R1 distills put DeepSeek's markers in the base
vocabulary's special slots. Families whose markers are not in the vocabulary (ChatML on
Llama 3) get them appended: their ids are then not the model's, which the audit does not
depend on (only on each marker being one added token). Stop tokens follow each family's
published ``generation_config.json``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from turnstile.dev.cache import build_digest, cache_root
from turnstile.dev.llama_cpp_assets import ensure_llama_cpp_assets
from turnstile.dev.qwen3_tokenizer import QWEN3_ADDED_TOKENS
from turnstile.dev.template_families import family_of, text_level_spec
from turnstile.dev.vocab import VocabSpec, ensure_vocab_tokenizer, load_tokenizer
from turnstile.tito.templates.audit import audit_template
from turnstile.tito.templates.battery import TOOLS
from turnstile.tito.templates.model import AuditError, AuditReport

__all__ = [
    "LEVEL_FAMILY",
    "LEVEL_OWN",
    "LEVEL_TEXT",
    "PAIRINGS",
    "TEMPLATE_KWARGS",
    "CorpusRow",
    "audit_corpus",
    "corpus_markdown",
    "corpus_summary",
    "pairing",
]

_QWEN2 = "ggml-vocab-qwen2.gguf"
_QWEN35 = "ggml-vocab-qwen35.gguf"
_LLAMA3 = "ggml-vocab-llama-bpe.gguf"
_PHI3 = "ggml-vocab-phi-3.gguf"
# Qwen2.5's added tokens are Qwen3's without <tool_response>, </tool_response>, <think>,
# </think> (ids 151665-151668).
_QWEN25_ADDED = QWEN3_ADDED_TOKENS[:22]
_QWEN_STOPS = ("<|im_end|>", "<|endoftext|>")

QWEN25 = VocabSpec(_QWEN2, _QWEN25_ADDED, eos_token="<|im_end|>", stop_tokens=_QWEN_STOPS)
QWEN3 = VocabSpec(_QWEN2, QWEN3_ADDED_TOKENS, eos_token="<|im_end|>", stop_tokens=_QWEN_STOPS)
QWEN35 = VocabSpec(_QWEN35, QWEN3_ADDED_TOKENS, eos_token="<|im_end|>", stop_tokens=_QWEN_STOPS)


def _deepseek_marker(words: str) -> str:
    """DeepSeek's marker spelling: fullwidth vertical bars, U+2581 for spaces."""
    return "<\uff5c" + words.replace(" ", "\u2581") + "\uff5c>"


_R1_BOS, _R1_EOS = _deepseek_marker("begin of sentence"), _deepseek_marker("end of sentence")
_R1_USER, _R1_ASSISTANT = _deepseek_marker("User"), _deepseek_marker("Assistant")
R1_DISTILL_QWEN = VocabSpec(
    _QWEN2,
    (
        (151643, _R1_EOS, True),
        (151644, _R1_USER, False),
        (151645, _R1_ASSISTANT, False),
        (151646, _R1_BOS, True),
        (151647, "<|EOT|>", True),
        (151648, "<think>", False),
        (151649, "</think>", False),
        *QWEN3_ADDED_TOKENS[7:22],
    ),
    eos_token=_R1_EOS,
    bos_token=_R1_BOS,
    stop_tokens=(_R1_EOS,),
)
_LLAMA31_SLOTS = (
    (128004, "<|finetune_right_pad_id|>", True),
    (128008, "<|eom_id|>", True),
    (128010, "<|python_tag|>", True),
)
LLAMA3 = VocabSpec(
    _LLAMA3,
    eos_token="<|eot_id|>",
    stop_tokens=("<|end_of_text|>", "<|eot_id|>"),
)
LLAMA31 = VocabSpec(
    _LLAMA3,
    _LLAMA31_SLOTS,
    eos_token="<|eot_id|>",
    stop_tokens=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
)
R1_DISTILL_LLAMA = VocabSpec(
    _LLAMA3,
    (
        (128000, _R1_BOS, True),
        (128001, _R1_EOS, True),
        (128011, _R1_USER, False),
        (128012, _R1_ASSISTANT, False),
        (128013, "<think>", False),
        (128014, "</think>", False),
    ),
    eos_token=_R1_EOS,
    bos_token=_R1_BOS,
    stop_tokens=(_R1_EOS,),
)
_CHATML = (("<|im_start|>", True), ("<|im_end|>", True))
HERMES_LLAMA3 = VocabSpec(
    _LLAMA3,
    _LLAMA31_SLOTS,
    appended_tokens=(
        *_CHATML,
        ("<tool_call>", False),
        ("</tool_call>", False),
        ("<tool_response>", False),
        ("</tool_response>", False),
    ),
    eos_token="<|im_end|>",
    stop_tokens=("<|im_end|>", "<|end_of_text|>"),
)
SMOLLM3 = VocabSpec(
    _LLAMA3,
    _LLAMA31_SLOTS,
    appended_tokens=(*_CHATML, ("<think>", False), ("</think>", False)),
    eos_token="<|im_end|>",
    stop_tokens=("<|im_end|>",),
)
PHI35 = VocabSpec(
    _PHI3,
    eos_token="<|endoftext|>",
    stop_tokens=("<|end|>", "<|assistant|>", "<|endoftext|>"),
)

PAIRINGS: dict[str, VocabSpec] = {
    "Qwen-Qwen2.5-7B-Instruct.jinja": QWEN25,
    "Qwen-Qwen3-0.6B.jinja": QWEN3,
    "Qwen-QwQ-32B.jinja": QWEN3,
    "Qwen3-Coder.jinja": QWEN3,
    "Qwen3.5-4B.jinja": QWEN35,
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": R1_DISTILL_QWEN,
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": R1_DISTILL_LLAMA,
    "meta-llama-Llama-3.1-8B-Instruct.jinja": LLAMA31,
    "meta-llama-Llama-3.2-3B-Instruct.jinja": LLAMA31,
    "meta-llama-Llama-3.3-70B-Instruct.jinja": LLAMA31,
    "fireworks-ai-llama-3-firefunction-v2.jinja": LLAMA3,
    "meetkai-functionary-medium-v3.1.jinja": LLAMA31,
    "meetkai-functionary-medium-v3.2.jinja": LLAMA3,
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": HERMES_LLAMA3,
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": HERMES_LLAMA3,
    "HuggingFaceTB-SmolLM3-3B.jinja": SMOLLM3,
    "microsoft-Phi-3.5-mini-instruct.jinja": PHI35,
}
# Variables a template requires from its caller, beyond the messages and tools.
TEMPLATE_KWARGS: dict[str, dict[str, Any]] = {
    # firefunction-v2 takes its function list as a JSON string and the date as text.
    "fireworks-ai-llama-3-firefunction-v2.jinja": {
        "functions": json.dumps([tool["function"] for tool in TOOLS], indent=2),
        "datetime": "2024-06-01",
    },
}
# Families paired with a vocabulary of the same family rather than the model's own
# (documented in the module docstring); every other pairing is the model's own vocabulary.
FAMILY_PAIRED: frozenset[str] = frozenset(
    {
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
        "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja",
        "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
        "HuggingFaceTB-SmolLM3-3B.jinja",
        "Qwen3.5-4B.jinja",
    }
)
LEVEL_OWN = "own vocabulary"
LEVEL_FAMILY = "family vocabulary"
LEVEL_TEXT = "text level"
# How many distinct break causes a table row names.
_NOTE_CAUSES = 2
# Characters of a reason kept in a table cell.
_NOTE_CHARS = 240
# Where audit results are cached, under the cache root (keyed by a digest of the inputs
# and the audit's code, so a change to either re-audits).
_RESULTS_DIR = "template-audit/results"
# The code an audit result depends on.
_AUDIT_SOURCES = (
    *sorted((Path(__file__).parent.parent / "tito" / "templates").glob("*.py")),
    Path(__file__).parent.parent / "tito" / "render.py",
    Path(__file__),
)


@dataclass(frozen=True)
class CorpusRow:
    """One template's audit: how it was paired (``level``: its own vocabulary, one of its
    family, or text level), the two answers (None: it could not be audited) and why."""

    template: str
    vocab: str | None
    level: str
    tito_exact: bool | None
    faithful: bool | None
    failing_kinds: tuple[str, ...]
    note: str

    @property
    def tito_safe(self) -> bool | None:
        if self.tito_exact is None or self.faithful is None:
            return None
        return self.tito_exact and self.faithful


def pairing(name: str, assets: Path) -> tuple[VocabSpec, str, str]:
    """The vocabulary ``name`` is audited with, its level and, for text level, why."""
    spec = PAIRINGS.get(name)
    if spec is not None:
        return spec, (LEVEL_FAMILY if name in FAMILY_PAIRED else LEVEL_OWN), ""
    family = family_of(name)
    if family is None:
        raise AuditError(f"{name}: no vocabulary pairing and no text-level family")
    members = sorted(path.name for path in (assets / "templates").glob("*.jinja"))
    texts = [
        (assets / "templates" / member).read_text(encoding="utf-8")
        for member in members
        if member not in PAIRINGS and family_of(member) is family
    ]
    why = family.note or f"no vendored vocabulary of the {family.name} family"
    return text_level_spec(family, texts), LEVEL_TEXT, why


def _row_from_report(
    name: str, spec: VocabSpec, level: str, why: str, report: AuditReport
) -> CorpusRow:
    causes = dict.fromkeys(
        result.break_.description for result in report.kinds if result.break_ is not None
    )
    notes: list[str] = []
    if why:
        notes.append(f"text level: {why}")
    notes += [reason[:_NOTE_CHARS] for reason in report.exact_reasons[:1]]
    notes += list(causes)[:_NOTE_CAUSES]
    notes += [
        f"fix verified: {fix.chat_template_kwargs}"
        + (" on a patched template" if "patched" in fix.description else "")
        for fix in report.fixes
        if fix.verified
    ]
    unsupported = [r.kind for r in report.kinds if r.status == "unsupported"]
    if unsupported:
        notes.append("unsupported: " + ", ".join(unsupported))
    return CorpusRow(
        name,
        spec.vocab_file,
        level,
        report.tito_exact,
        report.deployment_faithful,
        tuple(report.failing_kinds()),
        "; ".join(notes),
    )


def _cache_key(name: str, template: str, spec: VocabSpec) -> str:
    recipe = {
        "template": name,
        "text": hashlib.sha256(template.encode()).hexdigest(),
        "spec": spec.digest(),
        "kwargs": TEMPLATE_KWARGS.get(name),
    }
    return build_digest(recipe, _AUDIT_SOURCES)[:32]


def audit_one(
    name: str, assets: Path, loaded: dict[VocabSpec, Any], quiet: Callable[[str], None]
) -> CorpusRow:
    """Audit one vendored template (or read its cached result)."""
    template = (assets / "templates" / name).read_text(encoding="utf-8")
    try:
        spec, level, why = pairing(name, assets)
    except AuditError as exc:
        return CorpusRow(name, None, LEVEL_TEXT, None, None, (), str(exc))
    cached = cache_root() / _RESULTS_DIR / f"{_cache_key(name, template, spec)}.json"
    if cached.is_file():
        data = json.loads(cached.read_text(encoding="utf-8"))
        return CorpusRow(**{**data, "failing_kinds": tuple(data["failing_kinds"])})
    if spec not in loaded:
        loaded[spec] = load_tokenizer(ensure_vocab_tokenizer(spec, log=quiet))
    try:
        report = audit_template(
            loaded[spec], template, chat_template_kwargs=TEMPLATE_KWARGS.get(name)
        )
        row = _row_from_report(name, spec, level, why, report)
    except AuditError as exc:
        note = (f"text level: {why}; " if why else "") + f"not auditable: {exc}"
        row = CorpusRow(name, spec.vocab_file, level, None, None, (), note[: 2 * _NOTE_CHARS])
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(".partial")
    partial.write_text(json.dumps(asdict(row), ensure_ascii=False), encoding="utf-8")
    partial.replace(cached)
    return row


def audit_corpus(
    templates: list[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> list[CorpusRow]:
    """Audit every vendored template (or the named ones): with its own vocabulary where
    vendored, a family vocabulary where paired, else at text level; a row per template.
    Results are cached by a digest of the template, vocabulary, variables and audit code."""
    quiet = log or (lambda _: None)
    assets = ensure_llama_cpp_assets(log=quiet)
    names = templates or sorted(path.name for path in (assets / "templates").glob("*.jinja"))
    loaded: dict[VocabSpec, Any] = {}
    rows: list[CorpusRow] = []
    for name in names:
        row = audit_one(name, assets, loaded, quiet)
        rows.append(row)
        if log is not None:
            log(f"{name}: TITO-exact {row.tito_exact}, faithful {row.faithful}")
    return rows


def corpus_markdown(rows: list[CorpusRow]) -> str:
    """The corpus table as Markdown: both answers and the reason for each template."""
    lines = [
        "| template | vocabulary | TITO-exact | deployment-faithful | failing kinds | "
        "reason / notes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    order = {LEVEL_OWN: 0, LEVEL_FAMILY: 1, LEVEL_TEXT: 2}
    for row in sorted(rows, key=lambda row: (order.get(row.level, 3), row.template)):
        exact = {True: "yes", False: "**no**", None: "—"}[row.tito_exact]
        faithful = {True: "yes", False: "no", None: "—"}[row.faithful]
        vocab = Path(row.vocab).stem.removeprefix("ggml-vocab-") if row.vocab else "—"
        if row.level != LEVEL_OWN:
            vocab += f" ({row.level})"
        failing = ", ".join(f"`{kind}`" for kind in row.failing_kinds) or "—"
        note = row.note.replace("|", "\\|").replace("\n", "\\n") or "—"
        lines.append(
            f"| {Path(row.template).stem} | {vocab} | {exact} | {faithful} | {failing} | {note} |"
        )
    return "\n".join(lines) + "\n"


def corpus_summary(rows: list[CorpusRow]) -> dict[str, int]:
    """Counts for the table's caption: audited, TITO-exact, faithful, refused, by level."""
    return {
        "templates": len(rows),
        "audited": sum(row.tito_exact is not None for row in rows),
        "tito_exact": sum(row.tito_exact is True for row in rows),
        "deployment_faithful": sum(row.faithful is True for row in rows),
        "refused": sum(row.tito_exact is not True for row in rows),
        **{
            level: sum(row.level == level for row in rows)
            for level in (LEVEL_OWN, LEVEL_FAMILY, LEVEL_TEXT)
        },
    }
