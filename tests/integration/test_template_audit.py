"""The chat template audit (``turnstile.tito.templates``) on real templates and vocabularies.

Uses llama.cpp's vendored chat templates and GGUF vocabularies (extracted into the Turnstile
cache on first use); the tokenizers built from them are cached there too, so only a cold
cache pays for building them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from turnstile.cli.check_template import EXIT_BAD_INPUT, EXIT_NOT_SAFE, EXIT_SAFE
from turnstile.cli.main import main
from turnstile.dev.llama_cpp_assets import ensure_llama_cpp_assets, read_llama_cpp_test_vectors
from turnstile.dev.template_corpus import (
    FAMILY_PAIRED,
    LEVEL_FAMILY,
    LEVEL_OWN,
    LEVEL_TEXT,
    PAIRINGS,
    PHI35,
    QWEN3,
    QWEN25,
    audit_corpus,
    corpus_markdown,
    corpus_summary,
)
from turnstile.dev.vocab import build_tokenizer_dir, ensure_vocab_tokenizer, load_tokenizer
from turnstile.tito.templates import AuditReport, audit_template, keep_reasoning_patch
from turnstile.tito.templates.fixes import hermes_tool_response_patch, r1_keep_reasoning_patch
from turnstile.tito.templates.model import JSON_SCHEMA

# llama.cpp's vocabularies and templates (a 76 MB download, cached); no vLLM.
pytestmark = pytest.mark.assets

QWEN3_TEMPLATE = "Qwen-Qwen3-0.6B.jinja"
QWEN25_TEMPLATE = "Qwen-Qwen2.5-7B-Instruct.jinja"
R1_QWEN_TEMPLATE = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
HERMES_TEMPLATES = (
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
)
IM_END = 151645

# A plain ChatML template with tool calls: every rendering extends the previous one.
CHATML = (
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content }}"
    "{%- for c in m.tool_calls or [] %}"
    "{{- '<tool_call>' + c.function.name + ' ' + (c.function.arguments | tojson) }}"
    "{{- '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def assets() -> Path:
    return ensure_llama_cpp_assets()


@pytest.fixture(scope="module")
def qwen3(assets: Path) -> Any:
    return load_tokenizer(ensure_vocab_tokenizer(QWEN3))


@pytest.fixture(scope="module")
def qwen25(assets: Path) -> Any:
    return load_tokenizer(ensure_vocab_tokenizer(QWEN25))


def _template(assets: Path, name: str) -> str:
    return (assets / "templates" / name).read_text(encoding="utf-8")


# --- Qwen3: reasoning of earlier turns is dropped ------------------------------------------


@pytest.fixture(scope="module")
def qwen3_report(qwen3: Any, assets: Path) -> AuditReport:
    return audit_template(qwen3, _template(assets, QWEN3_TEMPLATE))


def test_qwen3_fails_where_it_drops_the_think_block(qwen3_report: AuditReport) -> None:
    assert not qwen3_report.tito_safe
    result = qwen3_report.kind("assistant.reasoning_content")
    assert result.status == "fail"
    assert result.prefix_preserving is False and result.token_prefix_preserving is False
    found = result.break_
    assert found is not None and found.level == "text"
    # Appending the next user message re-renders assistant message 1 without its block.
    assert found.trigger == ["user"] and found.changed_index == 1
    assert "reasoning" in found.description
    before, after = found.earlier.split(" | ")
    assert before.endswith("<|im_start|>assistant\\n'")
    assert after.startswith("'<think>\\nReasoning 1")
    assert found.later.split(" | ")[1].startswith("'Answer 1: mild.")
    assert found.earlier_tokens[3] == "<think>" and found.later_tokens[3] == "Answer"


def test_qwen3_passes_where_it_should(qwen3_report: AuditReport) -> None:
    for kind in ("system", "user", "tool"):
        assert qwen3_report.kind(kind).status == "pass", kind
    # Within one user turn's tool loop the reasoning is kept: the only break in that
    # conversation comes with the next user message.
    loop = qwen3_report.kind("assistant.reasoning_tool_call").break_
    assert loop is not None and loop.trigger == ["user"]
    end = qwen3_report.kind("assistant").end_of_turn
    assert end is not None and end.marker == "<|im_end|>" and end.token_id == IM_END
    assert end.is_eos and end.is_stop_token and end.trailing == "\n"


def test_qwen3_fix_is_verified(qwen3: Any, assets: Path, qwen3_report: AuditReport) -> None:
    verified = [fix for fix in qwen3_report.fixes if fix.verified]
    assert len(verified) == 1
    assert verified[0].chat_template_kwargs == {"preserve_thinking": True}
    assert "Qwen3.6" in verified[0].description
    patched = keep_reasoning_patch(_template(assets, QWEN3_TEMPLATE))
    assert patched is not None
    keep = {"preserve_thinking": True}
    assert audit_template(qwen3, patched, chat_template_kwargs=keep).tito_safe
    # Without the flag the patched template behaves as the original.
    assert not audit_template(qwen3, patched, suggest_fixes=False).tito_safe


# --- Qwen2.5: prefix-preserving ------------------------------------------------------------


def test_qwen25_renders_plain_chatml_by_hand(qwen25: Any, assets: Path) -> None:
    template = _template(assets, QWEN25_TEMPLATE)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    prompt = qwen25.apply_chat_template(
        messages[:1], chat_template=template, add_generation_prompt=True, tokenize=False
    )
    full = qwen25.apply_chat_template(messages, chat_template=template, tokenize=False)
    system = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    assert prompt == system + "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )
    assert full == prompt + "Hello<|im_end|>\n"


def test_qwen25_is_tito_safe(qwen25: Any, assets: Path) -> None:
    report = audit_template(qwen25, _template(assets, QWEN25_TEMPLATE))
    assert report.tito_safe, report.reasons
    statuses = {result.kind: result.status for result in report.kinds}
    assert statuses["assistant"] == statuses["assistant.parallel_tool_calls.dict_args"] == "pass"
    # Qwen2.5 has no reasoning support: the fields are not rendered, which is reported.
    assert statuses["assistant.reasoning_content"] == "ignored"
    assert any("reasoning_content" in warning for warning in report.warnings)


def test_raw_json_string_arguments_are_reserialised(qwen25: Any, assets: Path) -> None:
    report = audit_template(qwen25, _template(assets, QWEN25_TEMPLATE), vllm_messages=False)
    assert report.failing_kinds() == ["assistant.parallel_tool_calls.json_args"]
    found = report.kind("assistant.parallel_tool_calls.json_args").break_
    assert found is not None and found.level == "content"
    assert "re-serialised" in found.description
    assert any("vLLM parses them" in fix.description for fix in report.fixes)


# --- Synthetic templates -------------------------------------------------------------------


def test_plain_chatml_passes(qwen3: Any) -> None:
    report = audit_template(qwen3, CHATML)
    assert report.tito_safe, report.reasons
    assert report.generation_prompt == "<|im_start|>assistant\n"


def test_changing_header_is_caught(qwen3: Any) -> None:
    counting = "{{- 'Turns: ' + (messages|length|string) + '\\n' }}" + CHATML
    report = audit_template(qwen3, counting)
    assert not report.tito_safe
    found = report.kind("user").break_ or report.kind("system").break_
    assert found is not None and found.level == "text" and found.changed_index == 0
    assert found.char_index == len("Turns: ")


def test_generation_prompt_unlike_history_is_caught(qwen3: Any) -> None:
    template = CHATML.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<answer>'")
    report = audit_template(qwen3, template)
    found = report.kind("assistant").break_
    assert found is not None and found.changed_index is None
    assert "generation prompt" in found.description


def test_token_merge_across_the_prompt_is_caught(qwen3: Any) -> None:
    # History renders an extra newline after the header: the text still extends the prompt,
    # but "\n" + "\n" tokenizes as one "\n\n" token.
    template = CHATML.replace(
        "'<|im_start|>' + m.role + '\\n' + m.content",
        "'<|im_start|>' + m.role + '\\n' + ('\\n' if m.role == 'assistant' else '') + m.content",
    )
    result = audit_template(qwen3, template).kind("assistant")
    assert result.prefix_preserving is True and result.token_prefix_preserving is False
    assert result.break_ is not None and result.break_.level == "tokens"


def test_end_of_turn_without_stop_token_is_caught(qwen3: Any) -> None:
    template = CHATML.replace("'<|im_end|>\\n'", "'\\n\\n'")
    report = audit_template(qwen3, template)
    end = report.kind("assistant").end_of_turn
    assert end is not None and not end.is_stop_token
    assert not report.tito_exact and not report.tito_safe
    assert any("token the model stops on" in reason for reason in report.exact_reasons)
    assert any("eos_token_id" in fix.description for fix in report.fixes)


def test_a_turn_closed_only_by_the_next_header_is_exact(qwen3: Any) -> None:
    # GLM-style: no end-of-turn marker; the model stops by sampling the next message's
    # header, which is a stop token. TITO finds the delta after it.
    template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- endif %}"
    )
    report = audit_template(qwen3, template, stop_token_ids=[151644])
    assert report.tito_exact, report.exact_reasons


def test_exact_but_not_faithful_reports_the_first_difference(qwen3_report: AuditReport) -> None:
    assert qwen3_report.tito_exact and not qwen3_report.deployment_faithful
    difference = next(d for d in qwen3_report.differences if "reasoning_content" in d)
    assert "first difference at char" in difference and "became" in difference


# --- JSON output and the command line ------------------------------------------------------


def test_json_schema(qwen3_report: AuditReport) -> None:
    data = json.loads(json.dumps(qwen3_report.to_dict()))
    assert data["schema"] == JSON_SCHEMA
    assert data["tito_safe"] is False and data["reasons"]
    assert data["tito_exact"] is True and data["exact_reasons"] == []
    assert data["deployment_faithful"] is False and data["differences"]
    assert set(data) >= {
        "tokenizer",
        "template_source",
        "template_sha256",
        "chat_template_kwargs",
        "vllm_messages",
        "warnings",
        "fixes",
        "kinds",
        "stop_token_ids",
        "generation_prompt",
        "conversations",
    }
    kind = data["kinds"]["assistant.reasoning_content"]
    assert kind["prefix_preserving"] is False and kind["status"] == "fail"
    assert set(kind["break"]) >= {
        "conversation",
        "level",
        "trigger",
        "changed",
        "char_index",
        "earlier",
        "later",
        "token_index",
        "earlier_tokens",
        "later_tokens",
        "description",
    }
    assert kind["end_of_turn"]["marker"] == "<|im_end|>"
    assert data["kinds"]["tool"]["break"] is None
    assert all(fix["description"] for fix in data["fixes"])


@pytest.fixture(scope="module")
def qwen_dirs(assets: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    vocab = assets / "vocab" / QWEN3.vocab_file
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "qwen25": build_tokenizer_dir(
            vocab, assets / "templates" / QWEN25_TEMPLATE, root / "qwen25", QWEN25
        ),
        "qwen3": build_tokenizer_dir(
            vocab, assets / "templates" / QWEN3_TEMPLATE, root / "qwen3", QWEN3
        ),
        "bare": build_tokenizer_dir(vocab, None, root / "bare", QWEN3),
    }


def test_build_tokenizer_dir(qwen_dirs: dict[str, Path], assets: Path) -> None:
    config = json.loads((qwen_dirs["qwen3"] / "tokenizer_config.json").read_text())
    assert config["chat_template"] == _template(assets, QWEN3_TEMPLATE)
    assert config["eos_token"] == "<|im_end|>"
    generation = json.loads((qwen_dirs["qwen3"] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [IM_END, 151643]
    assert "chat_template" not in json.loads(
        (qwen_dirs["bare"] / "tokenizer_config.json").read_text()
    )


def test_cli_exit_codes(
    qwen_dirs: dict[str, Path], assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check-template", str(qwen_dirs["qwen25"])]) == EXIT_SAFE
    assert "verdict: TITO-safe" in capsys.readouterr().out
    out_json = tmp_path / "report.json"
    # Qwen3 drops earlier <think> blocks: TITO-exact but not deployment-faithful, so TITO
    # with tito_history: sampled (the default) takes it as it is, and tito_history: template
    # takes it with its verified fix.
    assert main(["check-template", str(qwen_dirs["qwen3"]), "--json", str(out_json)]) == (EXIT_SAFE)
    text = capsys.readouterr().out
    assert "verdict: NOT TITO-safe" in text and "<think>" in text
    assert "tito_history: sampled accepts" in text
    report = json.loads(out_json.read_text())
    assert report["schema"] == JSON_SCHEMA
    assert report["tito_exact"] and not report["deployment_faithful"]
    qwen3_template = ["check-template", str(qwen_dirs["qwen3"]), "--tito-history", "template"]
    assert main(qwen3_template) == EXIT_SAFE
    # A turn that does not end in a token the model stops on: refused in both modes.
    no_stop = tmp_path / "no-stop.jinja"
    no_stop.write_text(CHATML.replace("'<|im_end|>\\n'", "'\\n\\n'"))
    for history in ("sampled", "template"):
        args = ["check-template", str(qwen_dirs["qwen3"]), "--template", str(no_stop)]
        assert main([*args, "--tito-history", history]) == EXIT_NOT_SAFE
        assert f"tito_history: {history} refuses" in capsys.readouterr().out
    # --template overrides the tokenizer's template.
    template = str(assets / "templates" / QWEN25_TEMPLATE)
    assert main(["check-template", str(qwen_dirs["qwen3"]), "--template", template]) == 0
    assert main(["check-template", str(qwen_dirs["qwen25"]), "--markdown"]) == EXIT_SAFE
    assert "| `assistant` | pass |" in capsys.readouterr().out
    for bad in (
        ["check-template", str(tmp_path / "missing")],
        ["check-template", str(qwen_dirs["bare"])],
        ["check-template", str(qwen_dirs["qwen3"]), "--template", str(tmp_path / "none.jinja")],
        ["check-template", str(qwen_dirs["qwen3"]), "--corpus"],
        ["check-template", str(qwen_dirs["qwen3"]), "--chat-template-kwargs", "[1]"],
        ["check-template"],
    ):
        assert main(bad) == EXIT_BAD_INPUT, bad
    assert "turnstile check-template:" in capsys.readouterr().err


def test_cli_chat_template_kwargs(
    qwen_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    patched = tmp_path / "qwen3-keep.jinja"
    original = json.loads((qwen_dirs["qwen3"] / "tokenizer_config.json").read_text())
    fixed = keep_reasoning_patch(original["chat_template"])
    assert fixed is not None
    patched.write_text(fixed)
    kwargs = '{"preserve_thinking": true}'
    faithful, dropped = tmp_path / "with.json", tmp_path / "without.json"
    args = ["check-template", str(qwen_dirs["qwen3"]), "--template", str(patched)]
    assert main([*args, "--chat-template-kwargs", kwargs, "--json", str(faithful)]) == EXIT_SAFE
    assert main([*args, "--json", str(dropped)]) == EXIT_SAFE  # exact: sampled takes it
    assert json.loads(faithful.read_text())["deployment_faithful"] is True
    assert json.loads(dropped.read_text())["deployment_faithful"] is False
    capsys.readouterr()


# --- Other vocabularies and the corpus -----------------------------------------------------


def test_spm_vocabulary_reproduces_llama_cpp(assets: Path) -> None:
    tokenizer = load_tokenizer(ensure_vocab_tokenizer(PHI35))
    vectors = read_llama_cpp_test_vectors(assets / "vocab" / PHI35.vocab_file)
    for text, ids in vectors:
        assert tokenizer.encode(text, add_special_tokens=False) == ids, text
    assert tokenizer.encode("<|end|>", add_special_tokens=False) == [32007]


def test_corpus(assets: Path) -> None:
    rows = audit_corpus()
    by_name = {row.template: row for row in rows}
    templates = sorted(path.name for path in (assets / "templates").glob("*.jinja"))
    assert sorted(by_name) == templates
    for name in templates:  # every template is audited, with the level said
        row = by_name[name]
        assert row.tito_exact is not None and row.faithful is not None, (name, row.note)
        expected = LEVEL_FAMILY if name in FAMILY_PAIRED else LEVEL_OWN
        assert row.level == (expected if name in PAIRINGS else LEVEL_TEXT), name
        if row.level == LEVEL_TEXT:
            assert row.note.startswith("text level: "), name
        if not row.tito_exact:
            assert row.note, name  # a refusal says why
    assert by_name[QWEN25_TEMPLATE].tito_safe is True
    assert by_name["meta-llama-Llama-3.1-8B-Instruct.jinja"].tito_safe is True
    # Exact but not faithful: used with a warning, refused only with tito_history template.
    for name in (QWEN3_TEMPLATE, *HERMES_TEMPLATES, "Qwen-QwQ-32B.jinja", R1_QWEN_TEMPLATE):
        assert by_name[name].tito_exact is True and by_name[name].faithful is False, name
    assert "assistant.reasoning_content" in by_name[QWEN3_TEMPLATE].failing_kinds
    # No end-of-turn token at all: refused.
    assert by_name["llama-cpp-rwkv-world.jinja"].tito_exact is False
    summary = corpus_summary(rows)
    assert summary["templates"] == summary["audited"] == len(templates)
    assert summary["tito_exact"] + summary["refused"] == len(templates)
    table = corpus_markdown(rows)
    assert table.startswith(
        "| template | vocabulary | TITO-exact | deployment-faithful | failing kinds |"
    )
    assert table.count("\n") == len(rows) + 2
    assert "| Qwen-Qwen3-0.6B | qwen2 | yes | no |" in table


def test_corpus_results_are_cached(
    assets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = QWEN25_TEMPLATE
    first = audit_corpus([name])
    calls: list[str] = []
    monkeypatch.setattr(
        "turnstile.dev.template_corpus.audit_template",
        lambda *args, **kwargs: calls.append("audited"),
    )
    assert audit_corpus([name]) == first and calls == []


# --- Known fixes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", {}),
        ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", {}),
        ("Qwen-QwQ-32B.jinja", {"preserve_thinking": True, "enable_thinking": True}),
        (R1_QWEN_TEMPLATE, {"preserve_thinking": True, "enable_thinking": True}),
    ],
)
def test_known_fix_is_verified(assets: Path, name: str, kwargs: dict[str, Any]) -> None:
    tokenizer = load_tokenizer(ensure_vocab_tokenizer(PAIRINGS[name]))
    report = audit_template(tokenizer, _template(assets, name))
    assert report.tito_exact and not report.deployment_faithful
    verified = [fix for fix in report.fixes if fix.verified]
    assert len(verified) == 1 and verified[0].template is not None, report.fixes
    assert verified[0].chat_template_kwargs == kwargs
    fixed = audit_template(
        tokenizer, verified[0].template, chat_template_kwargs=kwargs, suggest_fixes=False
    )
    assert fixed.tito_safe, fixed.reasons
    assert report.to_dict()["fixes"][0]["patched_template"] is True


def test_r1_keep_reasoning_fix_is_audited(assets: Path) -> None:
    tokenizer = load_tokenizer(ensure_vocab_tokenizer(PAIRINGS[R1_QWEN_TEMPLATE]))
    template = _template(assets, R1_QWEN_TEMPLATE)
    patched = r1_keep_reasoning_patch(template)
    assert patched is not None
    keep = {"preserve_thinking": True, "enable_thinking": True}
    after = audit_template(tokenizer, patched, chat_template_kwargs=keep, suggest_fixes=False)
    # Every turn's reasoning is kept: no reasoning kind differs any more.
    for kind in (
        "assistant",
        "assistant.reasoning_content",
        "assistant.think_in_content",
        "assistant.tool_call",
        "assistant.reasoning_tool_call",
    ):
        assert after.kind(kind).status in ("pass", "ignored"), (kind, after.kind(kind).break_)
    before = audit_template(tokenizer, template, suggest_fixes=False)
    assert before.kind("assistant.reasoning_content").status == "fail"
    assert any(fix.template is not None for fix in audit_template(tokenizer, template).fixes)


def test_hermes_patch_renders_the_last_tool_response_as_history_does(assets: Path) -> None:
    template = _template(assets, HERMES_TEMPLATES[0])
    patched = hermes_tool_response_patch(template)
    assert patched is not None and hermes_tool_response_patch(CHATML) is None
    assert patched.count("</tool_response>\n") == template.count("</tool_response>\n") + 1
