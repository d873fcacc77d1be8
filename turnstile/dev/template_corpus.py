"""The template corpus: every vendored chat template that pairs with a vendored vocabulary.

llama.cpp vendors about 70 verbatim chat templates and a few real vocabularies
(``turnstile.dev.llama_cpp_assets.ensure_llama_cpp_assets``). ``PAIRINGS`` maps each template that
belongs to a family with a vendored vocabulary to a ``VocabSpec`` for that family;
``SKIPPED`` says why the others cannot be paired. ``audit_corpus`` audits every pairing and
returns a table row per template; ``corpus_markdown`` formats it for docs/tito.md.

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

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnstile.dev.llama_cpp_assets import ensure_llama_cpp_assets
from turnstile.dev.qwen3_tokenizer import QWEN3_ADDED_TOKENS
from turnstile.dev.vocab import VocabSpec, ensure_vocab_tokenizer, load_tokenizer
from turnstile.tito.templates.audit import audit_template
from turnstile.tito.templates.battery import TOOLS
from turnstile.tito.templates.model import AuditError

__all__ = ["PAIRINGS", "SKIPPED", "TEMPLATE_KWARGS", "CorpusRow", "audit_corpus", "corpus_markdown"]

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
# Why a template has no pairing, by file-name prefix (first match wins).
SKIPPED: tuple[tuple[str, str], ...] = (
    ("mistralai-", "Mistral's Tekken (tiktoken-based) vocabulary is not vendored"),
    ("unsloth-mistral-", "Mistral's Tekken (tiktoken-based) vocabulary is not vendored"),
    ("Mistral-", "Mistral's Tekken (tiktoken-based) vocabulary is not vendored"),
    ("google-gemma-4", "the gemma4 GGUF tokenizer model is not one this builder rebuilds"),
    ("google-gemma-2", "Gemma 2's vocabulary is not vendored"),
    ("deepseek-ai-DeepSeek-V", "DeepSeek-V3's vocabulary is not vendored"),
    ("llama-cpp-deepseek-r1", "DeepSeek-R1's (V3) vocabulary is not vendored"),
    ("CohereForAI-", "the command-r pre-tokenizer is not one this builder rebuilds"),
    ("Cohere2", "the command-r pre-tokenizer is not one this builder rebuilds"),
)
_DEFAULT_SKIP = "no vendored vocabulary of this model's tokenizer"
# How many distinct break causes a table row names.
_NOTE_CAUSES = 2


@dataclass(frozen=True)
class CorpusRow:
    template: str
    vocab: str | None
    tito_safe: bool | None  # None: skipped or could not be audited
    failing_kinds: tuple[str, ...]
    note: str


def skip_reason(template_name: str) -> str:
    for prefix, reason in SKIPPED:
        if template_name.startswith(prefix):
            return reason
    return _DEFAULT_SKIP


def audit_corpus(
    templates: list[str] | None = None,
    log: Callable[[str], None] | None = None,
    include_skipped: bool = True,
) -> list[CorpusRow]:
    """Audit every vendored template that pairs with a vendored vocabulary (or the named
    ones) and return a row per template, skipped ones included with their reason."""
    quiet = log or (lambda _: None)
    assets = ensure_llama_cpp_assets(log=quiet)
    names = templates or sorted(path.name for path in (assets / "templates").glob("*.jinja"))
    loaded: dict[VocabSpec, Any] = {}
    rows: list[CorpusRow] = []
    for name in names:
        spec = PAIRINGS.get(name)
        if spec is None:
            if include_skipped:
                rows.append(CorpusRow(name, None, None, (), skip_reason(name)))
            continue
        if spec not in loaded:
            loaded[spec] = load_tokenizer(ensure_vocab_tokenizer(spec, log=quiet))
        template = (assets / "templates" / name).read_text(encoding="utf-8")
        try:
            report = audit_template(
                loaded[spec], template, chat_template_kwargs=TEMPLATE_KWARGS.get(name)
            )
        except AuditError as exc:
            rows.append(CorpusRow(name, spec.vocab_file, None, (), f"not auditable: {exc}"))
            continue
        causes = dict.fromkeys(
            result.break_.description for result in report.kinds if result.break_ is not None
        )
        notes = list(causes)[:_NOTE_CAUSES]
        notes += [
            f"fix verified: {fix.chat_template_kwargs}"
            + (" on a patched template" if "patched" in fix.description else "")
            for fix in report.fixes
            if fix.verified
        ]
        unsupported = [r.kind for r in report.kinds if r.status == "unsupported"]
        if unsupported:
            notes.append("unsupported: " + ", ".join(unsupported))
        note = "; ".join(notes)
        rows.append(
            CorpusRow(name, spec.vocab_file, report.tito_safe, tuple(report.failing_kinds()), note)
        )
        if log is not None:
            log(f"{name}: {'TITO-safe' if report.tito_safe else 'not TITO-safe'}")
    return rows


def corpus_markdown(rows: list[CorpusRow]) -> str:
    """The corpus table as Markdown (audited templates first, then skipped ones)."""
    lines = [
        "| template | vocabulary | TITO-safe | failing kinds | notes |",
        "| --- | --- | --- | --- | --- |",
    ]
    ordered = sorted(rows, key=lambda row: (row.vocab is None, row.template))
    for row in ordered:
        verdict = {True: "yes", False: "no", None: "—"}[row.tito_safe]
        vocab = Path(row.vocab).stem.removeprefix("ggml-vocab-") if row.vocab else "—"
        failing = ", ".join(f"`{kind}`" for kind in row.failing_kinds) or "—"
        note = row.note.replace("|", "\\|") or "—"
        lines.append(f"| {Path(row.template).stem} | {vocab} | {verdict} | {failing} | {note} |")
    return "\n".join(lines) + "\n"
