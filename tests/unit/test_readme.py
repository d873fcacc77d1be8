"""The documented schema table is the one the code declares; CI runs the README's test
command and its quickstart."""

from __future__ import annotations

from pathlib import Path

from turnstile.dev.quickstart import quickstart_blocks
from turnstile.output.schema import schema_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_documented_schema_table_matches_the_declared_schema() -> None:
    readme = (ROOT / "docs" / "schema.md").read_text(encoding="utf-8")
    begin = readme.index("<!-- schema:begin")
    begin = readme.index("\n", begin) + 1
    end = readme.index("<!-- schema:end -->")
    documented = readme[begin:end].strip().replace("#### `", "### `")
    assert documented == schema_markdown().strip(), (
        "run `turnstile schema` and update docs/schema.md"
    )


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    command = ".venv/bin/python -m pytest"
    assert command in readme and command in ci


def test_ci_proves_the_readme_quickstart() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "python -m turnstile.dev.quickstart" in ci
    command, snippets = quickstart_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    assert command.endswith("turnstile demo")
    assert "'.[demo]'" in command  # the snippets' openai and httpx
    assert len(snippets) == 2 and "wait_for([rid]" in snippets[1]
