"""The drift corpus across every vendored template: TITO exact, record mode breaks flagged.

Every chat template llama.cpp vendors, each with the vocabulary the template audit pairs it
with (its own, one of its family, or text level), runs the corpus's multi-turn tool-using
conversations (adversarial content) through the whole app in both modes
(`turnstile.dev.drift`). TITO mode must produce one sample per rollout equal to the exact
token stream the backend consumed and produced (zero mismatching tokens) for every template
whose delta can be found (TITO-exact), faithful to the template's rendering or not; it must
refuse exactly the templates that are not. Record mode must detect and classify every
break, and never merge through one.
"""

from __future__ import annotations

import pytest

from turnstile.dev.drift import TemplateDrift, corpus
from turnstile.dev.llama_cpp_assets import ensure_llama_cpp_assets
from turnstile.dev.template_corpus import CorpusRow, audit_corpus

# llama.cpp's vocabularies and templates (a 76 MB download, cached); no vLLM.
pytestmark = pytest.mark.assets

KNOWN_KINDS = {"rerender", "tokenization", "truncated", "history_rewritten"}
# A template whose conversations the corpus cannot express (e.g. tool messages without a
# name for Kimi K3): reported, not measured.
CANNOT_RUN = "the corpus cannot run on this template"


@pytest.fixture(scope="module")
def rows() -> list[TemplateDrift]:
    return corpus(log=lambda _: None)


@pytest.fixture(scope="module")
def audit() -> dict[str, CorpusRow]:
    return {row.template.removesuffix(".jinja"): row for row in audit_corpus()}


def test_every_vendored_template_ran(rows: list[TemplateDrift]) -> None:
    assets = ensure_llama_cpp_assets(log=lambda _: None)
    names = {path.stem for path in (assets / "templates").glob("*.jinja")}
    assert {row.template for row in rows} == names
    ran = [row for row in rows if not (row.record.refused or "").startswith(CANNOT_RUN)]
    assert len(ran) >= len(names) - 5, [row.template for row in rows if row not in ran]


def test_tito_is_exact_for_every_template_whose_delta_can_be_found(
    rows: list[TemplateDrift], audit: dict[str, CorpusRow]
) -> None:
    measured = 0
    for row in rows:
        tito = row.tito
        if (tito.refused or "").startswith(CANNOT_RUN):
            continue
        if not audit[row.template].tito_exact:
            assert tito.refused is not None and "not TITO-exact" in tito.refused, row.template
            continue
        assert tito.refused is None, (row.template, tito.refused)
        assert tito.turns == row.record.turns, row.template
        assert tito.true_breaks == 0 and tito.breaks == {}, (row.template, tito)
        assert tito.mismatched_tokens == 0 and tito.merged_through == 0, row.template
        measured += tito.turns > 0
    assert measured >= 50


def test_record_mode_detects_and_classifies_every_break(rows: list[TemplateDrift]) -> None:
    for row in rows:
        record = row.record
        assert sum(record.breaks.values()) == record.true_breaks, (row.template, record)
        assert set(record.breaks) <= KNOWN_KINDS, (row.template, record.breaks)
        assert record.merged_through == 0 and record.mismatched_tokens == 0, row.template
    # The corpus is adversarial: record mode drifts on nearly every template.
    drifted = [row for row in rows if row.record.true_breaks > 0]
    assert len(drifted) >= len(rows) // 2
