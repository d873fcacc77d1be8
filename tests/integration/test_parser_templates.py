"""Which output parsers the real chat templates vendored by llama.cpp get."""

from __future__ import annotations

from pathlib import Path

import pytest

from turnstile.dev.llama_cpp_assets import ensure_llama_cpp_assets
from turnstile.tito.parsers import ParserSpec, parser_for_template

# llama.cpp's vocabularies and templates (a 76 MB download, cached); no vLLM.
pytestmark = pytest.mark.assets


@pytest.fixture(scope="module")
def templates() -> Path:
    return ensure_llama_cpp_assets(log=lambda _: None) / "templates"


REAL_TEMPLATES = [
    ("Qwen-Qwen3-0.6B", ParserSpec("hermes", "qwen3", False)),
    ("Qwen-QwQ-32B", ParserSpec("hermes", "qwen3", True)),
    ("Qwen-Qwen2.5-7B-Instruct", ParserSpec("hermes")),
    ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", ParserSpec("hermes")),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", ParserSpec("hermes")),
    ("meta-llama-Llama-3.1-8B-Instruct", ParserSpec("llama3_json")),
    ("meta-llama-Llama-3.2-3B-Instruct", ParserSpec("llama3_json")),
    ("meta-llama-Llama-3.3-70B-Instruct", ParserSpec("llama3_json")),
    ("mistralai-Mistral-Nemo-Instruct-2407", ParserSpec("mistral")),
    ("Mistral-Small-3.2-24B-Instruct-2506", ParserSpec("mistral")),
    ("unsloth-mistral-Devstral-Small-2507", ParserSpec("mistral")),
    ("mistralai-Ministral-3-14B-Reasoning-2512", ParserSpec("mistral", "mistral", False)),
]


@pytest.mark.parametrize(("stem", "expected"), REAL_TEMPLATES, ids=[s for s, _ in REAL_TEMPLATES])
def test_parser_for_real_templates(templates: Path, stem: str, expected: ParserSpec) -> None:
    path = templates / f"{stem}.jinja"
    assert path.is_file(), f"{path.name} is not among the pinned vendored templates"
    assert parser_for_template(path.read_text(encoding="utf-8")) == expected


@pytest.mark.parametrize(
    "stem", ["deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B"]
)
def test_r1_distill_templates_open_reasoning(templates: Path, stem: str) -> None:
    path = templates / f"{stem}.jinja"
    spec = parser_for_template(path.read_text(encoding="utf-8"))
    assert (spec.tool, spec.reasoning, spec.starts_in_reasoning) == ("plain", "qwen3", True)
    assert any("DeepSeek tool calls" in note for note in spec.notes)
