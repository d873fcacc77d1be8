"""The drift corpus across real templates: TITO mode exact, record mode breaks all flagged.

Every vendored llama.cpp template that pairs with a vendored vocabulary runs the corpus's
multi-turn tool-using conversations (adversarial content) through the whole app in both
modes (`turnstile.dev.drift`). TITO mode must produce one sample per rollout equal to the
exact token stream the backend consumed and produced (zero mismatching tokens) for every
template that passes the audit (or whose verified fix was applied); record mode must detect
and classify every break, and never merge through one.
"""

from __future__ import annotations

import pytest

from turnstile.dev.drift import TemplateDrift, corpus
from turnstile.dev.template_corpus import PAIRINGS, audit_corpus

# llama.cpp's vocabularies and templates (a 76 MB download, cached); no vLLM.
pytestmark = pytest.mark.assets

KNOWN_KINDS = {"rerender", "tokenization", "truncated", "history_rewritten"}


@pytest.fixture(scope="module")
def rows() -> list[TemplateDrift]:
    return corpus(log=lambda _: None)


def test_every_paired_template_ran(rows: list[TemplateDrift]) -> None:
    assert {f"{row.template}.jinja" for row in rows} == set(PAIRINGS)
    assert all(row.record.turns > 0 for row in rows)


def test_tito_is_exact_for_every_template_that_passes_the_audit(
    rows: list[TemplateDrift],
) -> None:
    safe = {row.template for row in audit_corpus(include_skipped=False) if row.tito_safe}
    ran = [row for row in rows if row.tito.refused is None]
    assert {row.template for row in ran} >= {name.removesuffix(".jinja") for name in safe}
    for row in ran:
        tito = row.tito
        assert tito.turns == row.record.turns, row.template
        assert tito.true_breaks == 0 and tito.breaks == {}, (row.template, tito)
        assert tito.mismatched_tokens == 0 and tito.merged_through == 0, row.template
    for row in rows:
        if row.tito.refused is not None:
            assert "not safe for TITO mode" in row.tito.refused, row.template


def test_record_mode_detects_and_classifies_every_break(rows: list[TemplateDrift]) -> None:
    for row in rows:
        record = row.record
        assert sum(record.breaks.values()) == record.true_breaks, (row.template, record)
        assert set(record.breaks) <= KNOWN_KINDS, (row.template, record.breaks)
        assert record.merged_through == 0 and record.mismatched_tokens == 0, row.template
    # The corpus is adversarial: record mode drifts on every template.
    assert all(row.record.true_breaks > 0 for row in rows)
